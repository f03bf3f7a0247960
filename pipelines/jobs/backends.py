"""One protocol for a job, wherever it runs: `kfvision job status | logs | list | delete |
download` ask a backend, and a local run and a job on a cluster answer alike.

The verbs are those kubeflow/sdk has every trainer backend implement (its `backends/base.py`: an
abstract class with train, get_job, list_jobs, get_job_logs with follow, wait_for_job_status and
delete_job; the local-process backend beside the Kubernetes one): here `status`, `list`, `logs`
(a replica's, or every one's with `all`), `follow`, `wait`, `delete` and `download`. Submitting
stays two commands, because the two do different things: `job run-local` runs the processes here
(pipelines/jobs/render.py: run_local), `job submit` creates the object
(pipelines/jobs/jobclient.py: submit).

    LocalJobs(log_dir=...)    the runs `job run-local` and `job run` record under build/jobs/NAME
                              (pipelines/jobs/localstatus.py: status.json; one <replica>.log each)
    ClusterJobs(namespace)    the cluster's PyTorchJobs and TrainJobs (pipelines/jobs/jobstatus.py,
                              podlogs.py, jobclient.py)

`pick(name, namespace, log_dir)`: with -n the cluster's; else the local run when there is one,
else the cluster's (a missing configuration then said with the local place looked at too).
A status is a view, one plain dict for both (pipelines/jobs/jobstatus.py says its keys).
"""

import abc
import os
import shutil
import signal
import time
from pathlib import Path

from kfvision.pipelines.clients.cluster import POLL_S
from kfvision.pipelines.jobs import localstatus, ranktag
from kfvision.pipelines.jobs.errors import InvalidJobError, JobOutputsError, JobTimeoutError

LOG_ROOT = Path("build") / "jobs"  # run-local's default: LOG_ROOT/NAME
ENDED = ("Succeeded", "Complete", "Failed", localstatus.STOPPED)  # phases a job does not leave


class JobBackend(abc.ABC):
    """The verbs of jobs in one place (this machine's runs, or one namespace of a cluster)."""

    @abc.abstractmethod
    def status(self, name: str, now: float) -> dict:
        """The view of job `name` at `now` (time.time())."""

    @abc.abstractmethod
    def list(self, now: float) -> list:
        """The views of every job, with their progress."""

    @abc.abstractmethod
    def logs(self, name: str, replica: str | None = None, *, all: bool = False,
             tail: int | None = None, previous: bool = False) -> list:
        """The lines of `replica`'s log (None: rank 0's), or with `all` every replica's, each
        prefixed `[node/rank] `."""

    @abc.abstractmethod
    def follow(self, name: str, write, note, *, replica: str | None = None, all: bool = False,
               poll_s: float = POLL_S) -> str:
        """Stream the log lines to `write` as they come (the state changes to `note`) until the
        job ends; its final phase."""

    @abc.abstractmethod
    def delete(self, name: str) -> str:
        """Delete the job (stopping it first where it runs); what was deleted, in words."""

    @abc.abstractmethod
    def download(self, name: str, path: str, out: Path) -> tuple:
        """(the local copy, where it came from, a note to print instead of "downloaded" or None)
        of `path` (model/..., outputs/...) of a script job's outputs."""

    def wait(self, name: str, timeout_s: float | None = None, poll_s: float = POLL_S) -> dict:
        """The view once the job has ended; JobTimeoutError after `timeout_s`."""
        start = time.monotonic()
        while True:
            view = self.status(name, time.time())
            if view["phase"] in ENDED:
                return view
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise JobTimeoutError(f"job {name} is still {view['phase']} after "
                                      f"{timeout_s:g} s.")
            time.sleep(poll_s)


class LocalJobs(JobBackend):
    """The runs of this machine: one folder each under `root` (or `log_dir` for the one named)."""

    def __init__(self, log_dir=None, root=LOG_ROOT):
        self.log_dir, self.root = log_dir, Path(root)

    def folder(self, name: str) -> Path:
        return Path(self.log_dir or self.root / name)

    def has(self, name: str) -> bool:
        """Whether this machine ran job `name`: its record, or its pods' folders."""
        folder = self.folder(name)
        return (folder / localstatus.RECORD).is_file() or (folder / "pods").is_dir()

    def _record(self, name: str, now: float | None = None) -> dict:
        record = localstatus.read(self.folder(name), now)
        if record is None:
            raise InvalidJobError(f"no local run of job {name} in {self.folder(name)} "
                                  "(--log-dir), and no -n for the cluster's.")
        return record

    @staticmethod
    def view(record: dict) -> dict:
        return {**record, "where": f"local run in {record['log_dir']}"}

    def status(self, name: str, now: float) -> dict:
        return self.view(self._record(name, now))

    def list(self, now: float) -> list:
        return [self.view(r) for r in localstatus.read_all(self.root)]

    def _replicas(self, name: str) -> dict:
        """{replica: its log file}, rank 0's first."""
        from kfvision.pipelines.jobs.kinds import named

        primary = named(self._record(name)["kind"].lower()).primary
        files = {p.stem: p for p in sorted(self.folder(name).glob("*.log"))}
        return dict(sorted(files.items(), key=lambda kv: kv[0] != primary))

    def _chosen(self, name: str, replica, all: bool) -> dict:
        files = self._replicas(name)
        if all:
            return files
        replica = replica or next(iter(files), None)
        if replica not in files:
            raise InvalidJobError(f"the local run of job {name} has no log of replica "
                                  f"{replica} (yet): it has {', '.join(files) or 'none'}.")
        return {replica: files[replica]}

    def _tagged(self, name: str, replica: str, line: str, all: bool) -> str:
        if not all:
            return line
        from kfvision.pipelines.jobs.kinds import named

        kind = named(self._record(name)["kind"].lower())
        node = kind.node_index({"metadata": {"name": replica}})
        return ranktag.tagged(line, replica if node is None else node)

    def logs(self, name: str, replica: str | None = None, *, all: bool = False,
             tail: int | None = None, previous: bool = False) -> list:
        if previous:
            raise InvalidJobError("--previous is a pod's; a local run's log holds every restart "
                                  "in one file (each start noted in it): drop --previous.")
        lines = []
        for rep, path in self._chosen(name, replica, all).items():
            text = path.read_text(encoding="utf-8", errors="replace").splitlines()
            lines += [self._tagged(name, rep, line, all) for line in text[-tail if tail else 0:]]
        return lines

    def follow(self, name: str, write, note, *, replica: str | None = None, all: bool = False,
               poll_s: float = POLL_S) -> str:
        offsets, last = {}, None
        while True:
            phase = self._record(name)["phase"]
            if phase != last:
                note(f"job {name} (local run in {self.folder(name)}): {phase}")
                last = phase
            for rep, path in self._chosen(name, replica, all).items():
                with path.open("rb") as f:
                    f.seek(offsets.get(rep, 0))
                    data = f.read()
                whole = data[:data.rfind(b"\n") + 1]  # a line still being written waits
                offsets[rep] = offsets.get(rep, 0) + len(whole)
                for line in whole.decode("utf-8", errors="replace").splitlines():
                    write(self._tagged(name, rep, line, all))
            if phase in ENDED:
                return phase
            time.sleep(min(poll_s, 1.0))

    def delete(self, name: str) -> str:
        record = self._record(name)
        if record["phase"] == localstatus.RUNNING:
            os.kill(int(record["pid"]), signal.SIGTERM)  # run-local stops every process
            deadline = time.monotonic() + 60
            while self._record(name)["phase"] == localstatus.RUNNING:
                if time.monotonic() > deadline:
                    raise InvalidJobError(f"job {name}'s run-local process ({record['pid']}) "
                                          "did not stop within 60 s of SIGTERM.")
                time.sleep(0.2)
        shutil.rmtree(self.folder(name))
        return f"{record['kind']} {name} (its local run in {self.folder(name)})"

    def download(self, name: str, path: str, out: Path) -> tuple:
        from kfvision.pipelines.jobs import outputs

        work = outputs.local_run(name, self.folder(name))
        if work is None:
            raise JobOutputsError(f"job {name} has no local run in {self.folder(name)} "
                                  "(--log-dir).")
        path = outputs.check_path(path)
        got = outputs.from_local(work, path, out)
        return got, f"its local run in {self.folder(name)}", outputs.empty_note(work, path, got)


class ClusterJobs(JobBackend):
    """The PyTorchJobs and TrainJobs of one namespace (None: the context's)."""

    def __init__(self, namespace: str | None = None):
        self.namespace = namespace

    def client(self, name: str | None = None):
        """A JobClient; of the kind that has job `name` when one is named."""
        from kfvision.pipelines.jobs.jobclient import attach, connect

        client = connect(self.namespace)
        return client if name is None else attach(client, name)

    def status(self, name: str, now: float) -> dict:
        from kfvision.pipelines.jobs.jobstatus import cluster_status

        return cluster_status(self.client(name), name, now)

    def list(self, now: float) -> list:
        from kfvision.pipelines.jobs.jobstatus import cluster_list

        return cluster_list(self.client().api, now)

    def logs(self, name: str, replica: str | None = None, *, all: bool = False,
             tail: int | None = None, previous: bool = False) -> list:
        from kfvision.pipelines.jobs import podlogs

        client = self.client(name)
        if all:
            return podlogs.merged(client, name, tail=tail, previous=previous)
        return client.logs(name, replica, tail=tail, previous=previous).splitlines()

    def follow(self, name: str, write, note, *, replica: str | None = None, all: bool = False,
               poll_s: float = POLL_S) -> str:
        from kfvision.pipelines.jobs import podlogs

        client = self.client(name)
        replicas = None if all else {replica or client.kind.primary}
        return podlogs.Follower(client, name, write=write, note=note, replicas=replicas,
                                tag=all).run(poll_s)

    def delete(self, name: str) -> str:
        client = self.client(name)
        client.delete(name)
        return f"{client.kind.kind} {client.namespace}/{name}"

    def download(self, name: str, path: str, out: Path) -> tuple:
        from kfvision.pipelines.jobs import outputs
        from kfvision.pipelines.jobs.podstatus import job_state

        path = outputs.check_path(path)
        client = self.client(name)
        what = f"{client.kind.kind} {client.namespace}/{name}"
        job = client.get(name)
        uri = outputs.output_uri(job, what)
        state, _ = job_state(job)
        if state != client.kind.succeeded:
            raise JobOutputsError(f"{what} is {state}, not {client.kind.succeeded}: node 0 "
                                  f"copies its outputs to {uri} after success.")
        return outputs.from_uri(uri, path, out), f"{what} ({uri})", None


def pick(name: str | None, namespace: str | None, log_dir=None, root=LOG_ROOT) -> JobBackend:
    """The backend that has job `name` (None: the one `job list` reads): -n means the
    cluster's; else this machine's when it has the run (any run, for a list), else the
    cluster's, whose failure to connect says where the local run was looked for too."""
    local = LocalJobs(log_dir, root)
    if namespace is None and (local.has(name) if name else local.list(time.time())):
        return local
    return _Fallback(ClusterJobs(namespace), local, name, namespace is not None)


WHERE_IS_IT = ("status", "list", "download")  # a 404 of these is said with the local place too


class _Fallback(JobBackend):
    """The cluster's backend, whose failure to connect (or a 404) is said with the local place
    that was looked at first."""

    def __init__(self, cluster: ClusterJobs, local: LocalJobs, name, explicit: bool):
        self.cluster, self.local, self.name, self.explicit = cluster, local, name, explicit

    def _call(self, verb, *args, **kw):
        from kfvision.pipelines.clients.endpoints import EndpointError
        from kfvision.pipelines.clients.k8s import KubernetesError

        try:
            return getattr(self.cluster, verb)(*args, **kw)
        except (KubernetesError, EndpointError) as e:
            status = getattr(e, "status", None)
            if self.explicit or status not in (None, 404) or (
                    status == 404 and verb not in WHERE_IS_IT):
                raise  # a job on the cluster that is not there is the cluster's answer
            place = self.local.folder(self.name) if self.name else self.local.root
            if isinstance(e, EndpointError):  # the cluster did not answer: its error, its exit code
                where = f"job {self.name}" if self.name else "a job"
                raise type(e)(f"{e} (nor is {where} in {place}, a local run)",
                              e.endpoint) from e
            if verb == "download":
                raise JobOutputsError(f"job {self.name} has no local run in {place} (--log-dir),"
                                      f" and the cluster has none either: {e}") from e
            what = f"no job {self.name}" if self.name else "no job"
            raise InvalidJobError(f"{what} in {place} (a local run), nor on the cluster: "
                                  f"{e}") from e

    def status(self, name, now):
        return self._call("status", name, now)

    def list(self, now):
        return self._call("list", now)

    def logs(self, name, replica=None, **kw):
        return self._call("logs", name, replica, **kw)

    def follow(self, name, write, note, **kw):
        return self._call("follow", name, write, note, **kw)

    def delete(self, name):
        return self._call("delete", name)

    def download(self, name, path, out):
        return self._call("download", name, path, out)
