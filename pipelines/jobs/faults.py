"""Fault injection for `run-local`: kill a pod or one training process at a chosen moment.

    kfvision job run-local job.yaml --fault 'worker-0/0:KILL:epoch 2 \\['

`TARGET:SIGNAL:PATTERN`: once a line of any replica's log matches PATTERN (a regular expression),
send SIGNAL to TARGET, once. TARGET is a replica (`worker-0`: every process of that pod, as when
its node is lost or the pod is evicted) or a replica and a local rank (`worker-0/0`: that one
training process, as the kernel's OOM killer does). This is how the tests show that a job survives
what a cluster does to it (docs/faults.md), and a drill a user can run before trusting a cluster
with a week-long job.
"""

import contextlib
import os
import re
import signal
import threading
import time
from dataclasses import dataclass

from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.procs import descendants, proc_table
from kfvision.trainer.forked import local_rank_of

_TARGET = re.compile(r"(?P<replica>(master|worker)-\d+|node-0-\d+)(/(?P<rank>\d+))?")


@dataclass(frozen=True)
class Fault:
    """Send `signal` to `target` once a log line matches `after`."""

    target: str  # "worker-0" (the whole pod) or "worker-0/1" (its training process of local rank 1)
    after: str  # regular expression, searched in every line of every replica's log
    signal: int = signal.SIGKILL

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """`TARGET:SIGNAL:PATTERN`, e.g. `worker-0/0:KILL:epoch 2 \\[` (SIGNAL: KILL, TERM, ...)."""
        parts = text.split(":", 2)
        if len(parts) != 3 or not parts[2]:
            raise InvalidJobError(f"--fault {text!r} is not TARGET:SIGNAL:PATTERN, e.g. "
                                  "'worker-0/0:KILL:epoch 2 \\['.")
        target, sig, after = parts
        try:
            number = signal.Signals[sig if sig.startswith("SIG") else "SIG" + sig]
        except KeyError as e:
            raise InvalidJobError(f"--fault {text!r}: {sig!r} is not a signal name (KILL, TERM, "
                                  "INT, ...).") from e
        fault = cls(target, after, int(number))
        fault.check()
        return fault

    def check(self, replicas=None) -> None:
        """Raise InvalidJobError unless the target (of `replicas`, when given) and pattern are
        valid."""
        m = _TARGET.fullmatch(self.target)
        if m is None or (replicas is not None and m["replica"] not in replicas):
            known = f" (this job has {', '.join(replicas)})" if replicas else ""
            raise InvalidJobError(f"fault target {self.target!r} is not a replica such as "
                                  f"master-0, worker-0 or (TrainJob) node-0-1, optionally "
                                  f"/LOCAL_RANK{known}.")
        try:
            re.compile(self.after)
        except re.error as e:
            raise InvalidJobError(f"fault pattern {self.after!r} is not a regular expression: "
                                  f"{e}") from e


class FaultInjector:
    """The line callback of every replica: passes lines on, and fires faults when they match.

    Call `attach(procs)` with the ReplicaProcess objects before they start."""

    def __init__(self, faults, on_line):
        self.pending, self.on_line = list(faults), on_line
        self.procs, self.fired, self.lock = {}, [], threading.Lock()

    def attach(self, procs) -> None:
        self.procs = {r.name: r for r in procs}
        for f in self.pending:
            f.check(list(self.procs))

    def __call__(self, name: str, line: str) -> None:
        self.on_line(name, line)
        if not self.pending:
            return
        with self.lock:
            due = [f for f in self.pending if re.search(f.after, line)]
            self.pending = [f for f in self.pending if f not in due]
        for f in due:
            note = self._fire(f)
            self.fired.append(note)
            self.on_line(name, f"--- fault: {note} ---")

    def _fire(self, fault: Fault) -> str:
        m = _TARGET.fullmatch(fault.target)
        r = self.procs[m["replica"]]
        sig = signal.Signals(fault.signal).name
        if r.proc is None or r.proc.poll() is not None:
            return f"{fault.target} is not running; {sig} not sent"
        table = proc_table()
        if m["rank"] is None:  # the whole pod: every process in it, as the kubelet would
            pids = [r.proc.pid] + sorted(p for p, _ in r.seen | descendants(r.proc.pid, table))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, fault.signal)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, fault.signal)
            return f"{sig} to every process of {fault.target} (pids {pids})"
        # the training process of that local rank: the topmost process of the pod with that
        # LOCAL_RANK (in its environment, or its name where the launcher forked it:
        # trainer/forked.py), a child of torchrun (DataLoader workers, its children, inherit
        # either too); torchrun is the pod's main process, or its child under a user's script's
        # boot
        for _ in range(50):  # the children may still be starting
            for pid in sorted(p for p, _ in descendants(r.proc.pid, table)):
                ppid = table[pid][0]
                if local_rank_of(pid) == int(m["rank"]) and (
                        ppid == r.proc.pid or local_rank_of(ppid) is None):
                    os.kill(pid, fault.signal)
                    return (f"{sig} to {fault.target} (pid {pid}) after a line matched "
                            f"{fault.after!r}")
            time.sleep(0.1)
            table = proc_table()
        return f"no training process of local rank {m['rank']} in {m['replica']}; {sig} not sent"
