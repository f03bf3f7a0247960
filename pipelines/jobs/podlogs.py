"""Every pod's log of a job, for `kfvision job logs NAME --all [--follow]`: each line with its
`[node/rank] ` prefix (pipelines/jobs/ranktag.py; a user's script's pods write it themselves,
other lines get their pod's node and `-`), interleaved by time; `--follow` waits through Pending
and streams each pod's container as it starts (and again after a restart) until the job ends.

    [0/-] [kfvision script] ready in 0.4 s; running train.py (torchrun)
    [0/0] epoch 1 loss 0.31
    [1/3] epoch 1 loss 0.33
"""

import threading

from kfvision.pipelines.clients.k8s import EndpointError, KubernetesError
from kfvision.pipelines.jobs import ranktag
from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.podstatus import container_status, job_state


def time_key(stamp: str) -> tuple:
    """A sort key of the kubelet's RFC 3339 time (`...T10:00:00.5Z`: its fraction has no trailing
    zeros, so the text itself does not sort)."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return whole, fraction.ljust(9, "0")


def _node(client, pod: dict):
    node = client.kind.node_index(pod)
    return client.kind.replica_name(pod) if node is None else node


def _started(client, pod: dict) -> bool:
    state = container_status(pod, client.kind).get("state") or {}
    return bool(state.get("running") or state.get("terminated"))


def merged(client, name: str, tail: int | None = None, previous: bool = False) -> list:
    """The lines of every pod of job `name` whose container has started, prefixed, oldest first.

    Raises:
        InvalidJobError: no pod of the job has started yet.
        KubernetesError: an API call failed.
    """
    pods = [p for p in client.pods(name) if _started(client, p)]
    if not pods:
        raise InvalidJobError(f"{client.kind.kind} {client.namespace}/{name} has no running "
                              "pod (yet); `kfvision job logs NAME --all --follow` waits for "
                              "them.")
    entries = []
    for order, pod in enumerate(pods):
        text = client.api.pod_log(pod["metadata"]["name"], client.kind.container, tail=tail,
                                  previous=previous, timestamps=True)
        node = _node(client, pod)
        for i, line in enumerate(text.splitlines()):
            stamp, _, rest = line.partition(" ")
            entries.append((time_key(stamp), order, i, ranktag.tagged(rest, node)))
    return [e[-1] for e in sorted(entries)]


class Follower:
    """Streams the logs of a job's pods (all, or those of `replicas`) to `write`, one thread per
    container; `note` gets the job's state changes."""

    def __init__(self, client, name: str, write, note, replicas=None, tag: bool = True):
        self.client, self.name, self.write, self.note = client, name, write, note
        self.replicas, self.tag = replicas, tag
        self.seen, self.threads, self.last = set(), [], None
        self.lock = threading.Lock()

    def _stream(self, pod_name: str, node) -> None:
        try:
            for line in self.client.follow_log(pod_name):
                self._out(ranktag.tagged(line, node) if self.tag else line)
        except (KubernetesError, EndpointError) as e:
            self._out(f"{ranktag.tag(node) if self.tag else ''}(log stream of pod {pod_name} "
                      f"ended: {e})")

    def _out(self, line: str) -> None:
        with self.lock:
            self.write(line)

    def _start_new(self) -> None:
        for pod in self.client.pods(self.name):
            if self.replicas and self.client.kind.replica_name(pod) not in self.replicas:
                continue
            status = container_status(pod, self.client.kind)
            key = (pod["metadata"].get("uid"), status.get("restartCount", 0))
            if key in self.seen or not _started(self.client, pod):
                continue
            self.seen.add(key)
            thread = threading.Thread(target=self._stream, daemon=True,
                                      args=(pod["metadata"]["name"], _node(self.client, pod)))
            thread.start()
            self.threads.append(thread)

    def poll(self):
        """One look at the job: start streaming new containers; the final state once it ended
        (every stream drained), else None."""
        state, message = job_state(self.client.get(self.name))
        if state != self.last:
            self.note(f"{self.client.kind.kind} {self.client.namespace}/{self.name}: {state}"
                      + (f" ({message})" if message else ""))
            self.last = state
        self._start_new()
        if state not in (self.client.kind.succeeded, "Failed"):
            return None
        for thread in self.threads:
            thread.join(timeout=10)  # let the last lines through
        return state

    def run(self, poll_s: float = 5.0) -> str:
        """Poll until the job has ended; its final state."""
        return self.client.api.wait_for(self.poll, None, poll_s, lambda: None)
