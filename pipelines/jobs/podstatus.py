"""What a job's status and its pods say, read from the API's plain dicts (no I/O): the job's
state from its conditions, why pods are not running, a log stream's lines."""

from kfvision.pipelines.jobs.kinds import JobKind


def job_state(job: dict) -> tuple:
    """(state, message) from status.conditions: the newest condition whose status is True."""
    conditions = [c for c in (job.get("status") or {}).get("conditions") or []
                  if c.get("status") == "True"]
    for terminal in ("Failed", "Succeeded", "Complete"):  # terminal wins over a later Running
        for c in conditions:
            if c.get("type") == terminal:
                return terminal, c.get("message") or c.get("reason") or ""
    if conditions:
        return conditions[-1].get("type"), conditions[-1].get("message") or ""
    jobs = (job.get("status") or {}).get("jobsStatus") or []  # a TrainJob's JobSet Jobs
    if any((j.get("active") or 0) > 0 for j in jobs):
        return "Running", ""
    return "Pending", "no status yet (is the Training Operator or Kubeflow Trainer running?)"


def split_lines(chunks):
    """Lines from a stream of byte chunks, the last one even without a newline."""
    buffer = b""
    for chunk in chunks:
        buffer += chunk if isinstance(chunk, bytes) else chunk.encode()
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if buffer:
        yield buffer.decode("utf-8", errors="replace")


def container_status(pod: dict, kind: JobKind) -> dict:
    for s in (pod.get("status") or {}).get("containerStatuses") or []:
        if s.get("name") == kind.container:
            return s
    return {}


def pod_problems(pods: list, kind: JobKind) -> list:
    """Why pods are not running yet (unschedulable, image pull errors), one line each."""
    lines = []
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") != "Pending":
            continue
        why = [c.get("message") for c in status.get("conditions") or []
               if c.get("type") == "PodScheduled" and c.get("status") == "False"]
        waiting = (container_status(pod, kind).get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            why.append(f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": "))
        lines.append(f"{kind.replica_name(pod)} is Pending"
                     + (f" ({'; '.join(why)})" if why else ""))
    return lines
