"""Run a PyTorchJob or TrainJob on a cluster: submit (or re-attach), wait, logs, delete. What
differs between the two kinds (API group, pod labels, container, success) is read from their
JobKind (pipelines/jobs/kinds.py); every API call goes through pipelines/clients/k8s.py, which
maps its failures. The Role in manifests/rbac.yaml grants exactly what is called here:
    pytorchjobs, trainjobs: create, get, delete    pods: list, get    pods/log: get
    (and for `job list`, list of both kinds: pipelines/jobs/jobstatus.py)
    clustertrainingruntimes, trainingruntimes: get (submit checks a TrainJob's runtime exists)
    persistentvolumeclaims: get (the train step's workspace)

The launcher is idempotent: submitting a job that already exists re-attaches to it. `JobClient`
speaks the verbs every cluster client does (pipelines/clients/cluster.py), logs included; a job is
the kind that a timeout deletes.
"""

import threading

from kfvision.pipelines.clients.cluster import POLL_S, LogsClient, submit_and_wait
from kfvision.pipelines.clients.k8s import Api, EndpointError, KubernetesError, Resource
from kfvision.pipelines.clients.k8s import connect as connect_api
from kfvision.pipelines.jobs.errors import InvalidJobError, JobFailedError, JobTimeoutError
from kfvision.pipelines.jobs.kinds import PYTORCHJOB, TRAINJOB, JobKind
from kfvision.pipelines.jobs.podstatus import (
    container_status,
    job_state,
    pod_problems,
    split_lines,
)
from kfvision.trainer.failures import first_failure


def connect(namespace: str | None = None, out=None, kind: JobKind = PYTORCHJOB) -> "JobClient":
    """A JobClient (of `kind`) for the current kubeconfig context, or the in-cluster config
    inside a pod (pipelines/clients/k8s.py: connect).

    Raises:
        KubernetesError: no usable configuration.
    """
    api = connect_api(namespace)
    api.out = out or api.out
    return JobClient(api, kind)


class JobClient(LogsClient):
    """Jobs of one kind in one namespace, through `api` (a kfvision.pipelines.clients.k8s.Api)."""

    command, deletes_on_timeout = "job", True  # a job that waited too long frees its GPUs

    def __init__(self, api: Api, kind: JobKind = PYTORCHJOB):
        super().__init__(api)
        self.kind = kind

    @property
    def what(self) -> str:
        return self.kind.kind

    def create(self, job: dict) -> tuple:
        """Create `job`; if it already exists, return that one instead. -> (object, created)."""
        return self.api.create(self.kind, job)

    def get(self, name: str) -> dict:
        return self.api.get(self.kind, name)

    def delete(self, name: str) -> None:
        """Delete the job; the operator's owner references take its pods and services along."""
        self.api.delete(self.kind, name)

    def pods(self, name: str) -> list:
        """The job's pods as dicts (from the operator's job-name label), by name."""
        return self.api.pods(f"{self.kind.pod_label}={name}")

    def pod_log(self, pod: str, tail: int | None = None, previous: bool = False) -> str:
        return self.api.pod_log(pod, self.kind.container, tail=tail, previous=previous)

    def logs(self, name: str, replica: str | None = None, *, tail: int | None = None,
             previous: bool = False) -> str:
        """The training container's log of the job's pod `replica` (None: rank 0's).

        Raises:
            InvalidJobError: the job has no such pod (yet).
        """
        replica = replica or self.kind.primary
        pod = self.find_pod(name, replica)
        if pod is None:
            raise InvalidJobError(f"{self.where(name)} has no pod for replica {replica} (yet); "
                                  f"see `kubectl get pods -l {self.kind.pod_label}={name}`, or "
                                  "--follow to wait for it.")
        return self.pod_log(pod["metadata"]["name"], tail=tail, previous=previous)

    def follow_log(self, pod: str):
        """The pod's training container's log line by line as it is written, until it ends."""
        yield from split_lines(self.api.follow_log(pod, self.kind.container))

    def own_claims(self, pod: str) -> dict:
        """{mount path: PVC name} of the volumes the pod `pod` (this step's own: its name is
        its HOSTNAME) mounts in its containers: the job's pods mount the same claims to see
        the step's files at the same paths."""
        spec = self.api.pod(pod)["spec"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in spec.get("volumes") or [] if v.get("persistentVolumeClaim")}
        return {m["mountPath"]: claims[m["name"]] for c in spec.get("containers") or []
                for m in c.get("volumeMounts") or [] if m["name"] in claims}

    def access_modes(self, claim: str) -> list:
        """The access modes PVC `claim` was bound with (those it asked for, while unbound)."""
        pvc = self.api.claim(claim)
        return (pvc.get("status") or {}).get("accessModes") or pvc["spec"].get("accessModes", [])

    def find_pod(self, name: str, replica: str) -> dict | None:
        return next((p for p in self.pods(name) if self.kind.replica_name(p) == replica), None)

    def failure_report(self, name: str, job: dict, tail: int = 20) -> str:
        """Which replica failed, why (exit code, reason), and its last log lines; first of all,
        the job's first failure when the launchers' records in those lines name it
        (trainer/failures.py)."""
        _, message = job_state(job)
        lines, read = [f"{self.kind.kind} {self.namespace}/{name} failed: {message}"], []
        for pod in self.pods(name):
            status = container_status(pod, self.kind)
            now = (status.get("state") or {}).get("terminated")
            before = (status.get("lastState") or {}).get("terminated")
            ended = now or before
            if not ended or ended.get("exitCode", 0) == 0:
                continue
            pod_name = pod["metadata"]["name"]
            lines.append(f"  {self.kind.replica_name(pod)} (pod {pod_name}) exited with code "
                         f"{ended.get('exitCode')}, reason {ended.get('reason', 'unknown')}"
                         + (f": {ended['message'].strip()}" if ended.get("message") else ""))
            try:
                log = self.pod_log(pod_name, tail=tail, previous=not now)
            except KubernetesError as e:  # the report must still say which replica failed
                log = f"(no log: {e})"
            last = log.rstrip("\n").splitlines()[-tail:]
            read += last
            lines += [f"    {line}" for line in last]
        verdict = first_failure(read)
        if verdict is not None:
            lines.insert(1, f"  {verdict.summary('the first failure of the job')}")
        if len(lines) == 1:
            lines.append("  no pod of it ended with a non-zero exit code (deleted, or the job "
                         f"failed before its pods ran: see `kubectl describe {self.kind.plural} "
                         f"{name} -n {self.namespace}`)")
        return "\n".join(lines)

    def _follow(self, pod: str, prefix: str) -> None:
        try:
            for line in self.follow_log(pod):
                self.say(f"[{prefix}] {line}")
        except (KubernetesError, EndpointError) as e:
            self.say(f"[{prefix}] (log stream ended: {e})")

    def _keep_following(self, name: str, seen: set, current):
        """(Re)start streaming the Master's log once its container runs, once per container."""
        if current is not None and current.is_alive():
            return current
        pod = self.find_pod(name, self.kind.primary)
        status = container_status(pod or {}, self.kind)
        state = status.get("state") or {}
        if not pod or not (state.get("running") or state.get("terminated")):
            return current
        key = (pod["metadata"].get("uid"), status.get("restartCount", 0))
        if key in seen:
            return current
        seen.add(key)
        thread = threading.Thread(target=self._follow, name=f"log-{name}", daemon=True,
                                  args=(pod["metadata"]["name"], self.kind.primary))
        thread.start()
        return thread

    def submit(self, job: dict) -> dict:
        """Create `job`, or re-attach to the one of its name, saying which (and, for one that
        has ended, how to run it again); a TrainJob's runtime is checked first."""
        name = job["metadata"]["name"]
        if self.kind is TRAINJOB:
            check_runtime(self, job)
        obj, created = self.create(job)
        state = job_state(obj)[0]
        if created:
            self.say(f"created {self.where(name)}")
        elif state in (self.kind.succeeded, "Failed"):  # e.g. submitted again after a fix
            self.say(f"{self.where(name)} already exists and has {state.lower()}: reporting that "
                     f"run (no new job is created). To run it again: kfvision job delete {name} "
                     f"-n {self.namespace}, then submit.")
        else:
            self.say(f"{self.where(name)} already exists: re-attaching to it (no second job is "
                     "created)")
        return obj

    def wait(self, name: str, timeout_s: float | None = None, poll_s: float = POLL_S,
             logs: bool = True) -> dict:
        """Poll the job's conditions until Succeeded (returns the job) or Failed (raises),
        streaming the Master's log meanwhile.

        Raises:
            JobFailedError: the job failed; names the failing replica, reason and last log lines.
            JobTimeoutError: `timeout_s` passed first (the job is left as it is).
            KubernetesError: an API call failed.
        """
        seen, follower, last, state = set(), None, None, None

        def poll():
            nonlocal follower, last, state
            job = self.get(name)
            state, message = job_state(job)
            if state != last:
                self.say(f"{self.kind.kind} {self.namespace}/{name}: {state}"
                         + (f" ({message})" if message else ""))
                last = state
            if logs:
                follower = self._keep_following(name, seen, follower)
            if state not in (self.kind.succeeded, "Failed"):
                return None
            if follower is not None:
                follower.join(timeout=10)  # let the last lines of the log through
            if state == "Failed":
                raise JobFailedError(self.failure_report(name, job))
            return job

        def timed_out():
            pending = pod_problems(self.pods(name), self.kind)
            return JobTimeoutError(
                f"{self.kind.kind} {self.namespace}/{name} did not finish within "
                f"{timeout_s:g} s (state {state})." + "".join(f"\n  {p}" for p in pending))

        return self.api.wait_for(poll, timeout_s, poll_s, timed_out)


def submit(client: JobClient, job: dict, *, wait: bool = False, timeout_s: float | None = None,
           keep_on_timeout: bool = False, poll_s: float = POLL_S, logs: bool = True) -> dict:
    """Create `job` (or re-attach to the one of that name) and optionally wait for it, streaming
    the log of rank 0 (`logs`): pipelines/clients/cluster.py's submit_and_wait, as the pipeline's
    train steps call it.

    On a timeout the job is deleted (its GPUs freed) unless `keep_on_timeout`.
    Returns:
        the job object (final, when waiting).
    Raises:
        JobFailedError, JobTimeoutError, KubernetesError: see JobClient.wait.
    """
    return submit_and_wait(client, job, wait=wait, timeout_s=timeout_s, poll_s=poll_s,
                           keep_on_timeout=keep_on_timeout, logs=logs)


def attach(client: JobClient, name: str) -> JobClient:
    """A client of the kind that has a job `name` (TrainJob first), for logs and delete.

    Raises:
        KubernetesError: neither a TrainJob nor a PyTorchJob of that name (status 404), or the
            first refusal (e.g. 403: a Role of an older kfvision grants only pytorchjobs).
    """
    refused = None
    for kind in (TRAINJOB, PYTORCHJOB):
        other = JobClient(client.api, kind)
        try:
            other.get(name)
        except KubernetesError as e:
            if e.status not in (403, 404):
                raise
            refused = refused or (e if e.status == 403 else None)
            continue
        return other
    if refused is not None:
        raise refused
    raise KubernetesError(f"there is no TrainJob or PyTorchJob {name} in namespace "
                          f"{client.namespace}: check the name and namespace (`kubectl get "
                          "trainjobs,pytorchjobs`).", 404)


def _runtime_resource(kind: str) -> Resource:
    return Resource(kind=kind, group=TRAINJOB.group, version=TRAINJOB.version,
                    plural=kind.lower() + "s", install=TRAINJOB.install)


def check_runtime(client: JobClient, job: dict) -> None:
    """Raise KubernetesError when the runtime a TrainJob references is missing (the webhook
    would refuse the job with a less helpful message); a 403 leaves the check to the webhook."""
    ref = job["spec"]["runtimeRef"]
    kind, name = ref.get("kind") or "ClusterTrainingRuntime", ref["name"]
    runtime = _runtime_resource(kind)
    try:
        if kind == "TrainingRuntime":
            client.api.get(runtime, name)
        else:
            client.api.get_cluster_scoped(runtime, name)
    except KubernetesError as e:
        if e.status == 403:
            return
        if e.status != 404:
            raise
        where = f" in namespace {client.namespace}" if kind == "TrainingRuntime" else ""
        how = (f"kubectl apply -f manifests/trainer-v2/{kind.lower()}.yaml"
               + (f" -n {client.namespace}" if where else "")
               if name == "kfvision-torch" else
               "install Kubeflow Trainer's runtimes (kubectl apply --server-side -k "
               "\"github.com/kubeflow/trainer.git/manifests/overlays/runtimes?ref=v2.3.0\")")
        raise KubernetesError(
            f"TrainJob {client.namespace}/{job['metadata']['name']} references {kind} {name}, "
            f"which the cluster does not have{where}: {how}, or render with another --runtime "
            "(`kubectl get clustertrainingruntimes,trainingruntimes -A` lists them).",
            404) from e
