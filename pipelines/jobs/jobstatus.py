"""Where a job on a cluster stands, for `kfvision job status NAME` and `kfvision job list`: its
phase (its conditions, pipelines/jobs/podstatus.py), its shape (nodes x processes), and its
progress and last metrics:

- a TrainJob: its `status.trainerStatus`, which Kubeflow Trainer's TrainJobStatus feature gate
  lets the job's pods write (the built-in trainer, a script's boot, or the script itself); without
  one (the gate off, or nothing reported yet), as for a PyTorchJob;
- a PyTorchJob (it has no status field for progress): the last LOG_TAIL lines of rank 0's pod,
  read as the pod's boot reads them (pipelines/jobs/progress.py), timed by the kubelet's stamps.

`job list` lists the jobs kfvision rendered (its labels, pipelines/jobs/config.py LABELS), of
both kinds the cluster serves, in one namespace, with their progress as `job status` reads it
(a TrainJob's status.trainerStatus, else rank 0's log: two requests per such job that runs). The
calls are those manifests/rbac.yaml grants: get and list of the jobs, list of pods, get of
pods/log.

A view is a plain dict (what `--json` prints): name, kind, where, phase, message, nodes, procs,
started, progress (pipelines/jobs/progress.py's snapshot shape, or None) and `source`, what the
progress was read from.
"""

from kfvision.pipelines.jobs.config import LABELS
from kfvision.pipelines.jobs.kinds import TRAINJOB, served_kinds
from kfvision.pipelines.jobs.podstatus import container_status, job_state
from kfvision.pipelines.jobs.progress import (
    Progress,
    from_trainer_status,
    rank0_text,
    rfc3339,
    totals_of,
)

LOG_TAIL = 500  # lines of rank 0's log read for a PyTorchJob's progress
SELECTOR = ",".join(f"{k}={v}" for k, v in LABELS.items())  # the jobs kfvision rendered


def _base(kind, job: dict, where: str) -> dict:
    state, message = job_state(job)
    nodes, procs = kind.shape(job)
    meta = job.get("metadata") or {}
    return {"name": meta.get("name"), "kind": kind.kind, "where": where, "phase": state,
            "message": message, "nodes": nodes, "procs": procs,
            "started": rfc3339(meta.get("creationTimestamp") or ""), "progress": None,
            "source": None}


def _from_status(view: dict, job: dict, now: float) -> bool:
    reported = (job.get("status") or {}).get("trainerStatus")
    if not reported:
        return False
    view.update(progress=from_trainer_status(reported, now), source="status.trainerStatus")
    return True


def log_progress(client, name: str, job: dict, now: float, tail: int = LOG_TAIL) -> dict | None:
    """The progress in the last `tail` lines of rank 0's pod of job `name` (None: no pod has
    started, or it printed no `name=value` line)."""
    pod = client.find_pod(name, client.kind.primary)
    state = container_status(pod or {}, client.kind).get("state") or {}
    if not (state.get("running") or state.get("terminated")):
        return None
    text = client.api.pod_log(pod["metadata"]["name"], client.kind.container, tail=tail,
                              timestamps=True)
    progress = Progress(totals_of(client.kind.trainer_env(job)))
    for line in text.splitlines():
        stamp, _, rest = line.partition(" ")
        said = rank0_text(rest)
        if said is not None:
            progress.feed(said, rfc3339(stamp) or now)
    return progress.snapshot(now) if progress.lines else None


def cluster_status(client, name: str, now: float) -> dict:
    """The view of job `name` through `client` (a JobClient of the job's kind: `attach`).

    Raises:
        KubernetesError, EndpointError: an API call failed.
    """
    job = client.get(name)
    view = _base(client.kind, job, f"namespace {client.namespace}")
    if client.kind is TRAINJOB and _from_status(view, job, now):
        return view
    got = log_progress(client, name, job, now)
    if got is not None:
        view.update(progress=got, source=f"the log of {client.kind.primary}")
    return view


def cluster_list(api, now: float) -> list:
    """The views of the jobs kfvision rendered in `api`'s namespace, of each kind the cluster
    serves, by name, with their progress (that of a job that no longer runs from its
    status.trainerStatus only).

    Raises:
        KubernetesError, EndpointError: an API call failed.
    """
    views = []
    for kind in served_kinds(api):
        for job in api.list(kind, SELECTOR):
            view = _base(kind, job, f"namespace {api.namespace}")
            if not (kind is TRAINJOB and _from_status(view, job, now)) and \
                    view["phase"] == "Running":
                from kfvision.pipelines.jobs.jobclient import JobClient

                name = view["name"]
                got = log_progress(JobClient(api, kind), name, job, now)
                if got is not None:
                    view.update(progress=got, source=f"the log of {kind.primary}")
            views.append(view)
    return sorted(views, key=lambda v: (v["name"], v["kind"]))
