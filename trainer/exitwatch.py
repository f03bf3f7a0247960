"""When each training process of a node ended, to the microsecond, seen by kfvision's launcher
(trainer/launch.py), their parent; and whether it ended by itself or was stopped.

torchrun's own record of a failure (`ProcessFailure.timestamp`) is whole seconds: the second its
monitor loop, every 0.1 s, found the process gone, or the one an error file gives. Ranks that fail
together then tie, and it names the lowest (trainer/failures.py says what that cost). So:

- **Where**: torchrun's elastic agent starts the processes in `_start_workers` and watches them
  in `_monitor_workers`, the methods torch's `SimpleElasticAgent` leaves to its subclasses. A
  subclass of its `LocalElasticAgent` (`watching`, put where torchrun's launcher looks it up)
  hands every process to an ExitWatch as it starts, with its global rank, and notes the moment
  the agent begins to stop them (a failure found, or a signal to the launcher).
- **How**: a thread waits on a pidfd per process (Linux 5.3+), which the kernel makes readable
  the moment the process ends; the exit status is read with `waitid(WNOWAIT)`, which leaves the
  process for torchrun to reap. Where pidfds are missing it looks every 10 ms instead. Before each
  of the agent's own checks (which reap) it looks once more, so no exit goes unstamped.
- **Why not in the training process** (an excepthook or atexit writing the time): a user's script
  runs unchanged, and a process killed by a signal runs no hook at all. Why not scan /proc: it
  would find a process only after it started, and learn its rank from its environment, which
  is the launcher's until it execs.
"""

import contextlib
import os
import select
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kfvision.trainer import failures

_TICK_S = 0.01  # how often to look without pidfds
_TAIL_BYTES = 64 * 1024  # of a rank's stderr file, for its last error


@dataclass
class _Child:
    rank: int
    local_rank: int
    pid: int
    stderr: str = ""  # torchrun's file of its stderr (--tee / --redirects), or ""
    popen: object = None  # torchrun's Popen of it: the status, once torchrun reaped it first
    fd: int | None = None  # its pidfd
    ended: float | None = None  # time.time() when it was found ended
    status: int | None = None  # Popen's convention: -N for a signal N; None: not known


class ExitWatch:
    """The processes of a node's current attempt: when each ended, with what status."""

    def __init__(self):
        self.node = 0
        self.stopping_at: float | None = None  # when the agent began to stop the processes
        self._children: dict = {}  # pid -> _Child
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, node: int, children) -> None:
        """A new attempt's processes: `children` (rank, local rank, pid, stderr file or None,
        Popen or None)."""
        with self._lock:
            self._close_fds()
            self.node, self.stopping_at = node, None
            self._children = {pid: _Child(rank, local, pid, stderr or "", popen)
                              for rank, local, pid, stderr, popen in children}
            for c in self._children.values():
                with contextlib.suppress(AttributeError, OSError):  # no pidfds: look every tick
                    c.fd = os.pidfd_open(c.pid)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kfvision-exitwatch",
                                            daemon=True)
            self._thread.start()
        os.write(self._wake_w, b"!")

    def stopping(self, since: float | None = None) -> None:
        """The agent began to stop the processes (`since`, default now): whatever ended since
        was stopped. The first call counts."""
        now = self.check()
        with self._lock:
            if self.stopping_at is None:
                self.stopping_at = now if since is None else since

    def check(self) -> float:
        """Stamp every process that has ended since the last look; returns the time it looked."""
        with self._lock:
            for c in self._children.values():
                if c.ended is None:
                    found, status = _peek(c.pid)
                    if found:
                        c.ended, c.status = time.time(), status
            return time.time()

    def close(self) -> None:
        """Stop the thread and close the pidfds; `records` and `check` still work (by pid)."""
        self._closed = True
        os.write(self._wake_w, b"!")
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                self._close_fds()

    def _close_fds(self) -> None:
        for c in self._children.values():
            if c.fd is not None:
                os.close(c.fd)
                c.fd = None

    def _loop(self) -> None:
        poller, registered = select.poll(), set()
        poller.register(self._wake_r, select.POLLIN)
        while not self._closed:
            with self._lock:
                waiting = {c.fd for c in self._children.values()
                           if c.fd is not None and c.ended is None}
                ticking = any(c.fd is None and c.ended is None for c in self._children.values())
            for fd in registered - waiting:
                poller.unregister(fd)
            for fd in waiting - registered:
                poller.register(fd, select.POLLIN)
            registered = waiting
            ready = poller.poll(_TICK_S * 1000 if ticking else None)
            if any(fd == self._wake_r for fd, _ in ready):
                os.read(self._wake_r, 4096)
            self.check()

    def records(self, started: float, torch_failures=None) -> list:
        """ExitRecords of the processes that did not succeed, in the order they ended.

        Args:
            started: time.time() when the launcher started (for each record's `after`).
            torch_failures: {global rank: ProcessFailure} of torchrun's ChildFailedError, if it
                raised one: its exit codes and error files, and what the watch lacks (a
                platform without waitid: then its whole-second times, and no stopped ranks).
        """
        self.check()
        torch_failures = torch_failures or {}
        by_pid = {c.pid: c for c in self._children.values()}
        ended = {c.rank: c for c in by_pid.values() if c.ended is not None}
        for rank, f in torch_failures.items():
            c = by_pid.get(f.pid) or _Child(rank, f.local_rank, f.pid)
            if c.ended is None:
                c.ended = float(f.timestamp)
            if c.status is None:
                c.status = f.exitcode
            ended[rank] = c
        out = []
        for rank, c in ended.items():
            if c.status is None and c.popen is not None:
                c.status = getattr(c.popen, "returncode", None)
            if c.status == 0:
                continue
            code = _container_code(c.status)
            stopped = self.stopping_at is not None and c.ended >= self.stopping_at
            error = _message(torch_failures.get(rank)) or failures.error_of(_tail(c.stderr))
            out.append(failures.ExitRecord(rank, self.node, c.local_rank, c.pid,
                                           failures.kind_of(code, error, stopped), c.ended,
                                           max(0.0, c.ended - started), code))
        return sorted(out, key=lambda r: (r.at, r.rank))


def _peek(pid: int) -> tuple:
    """(ended, status) of child `pid`, leaving it unreaped; status None when torchrun reaped it
    first (its ProcessFailure then has the code)."""
    try:
        res = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True, None
    if res is None:
        return False, None
    return True, res.si_status if res.si_code == os.CLD_EXITED else -res.si_status


def _container_code(status: int | None) -> int:
    if status is None:
        return 1
    return 128 - status if status < 0 else status


def _message(failure) -> str | None:
    """The `TYPE: message` of a process's error file (a script under torch's `@record`)."""
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message")
    text = message.get("message") if isinstance(message, dict) else message
    return failures.error_of([text]) if isinstance(text, str) and text else None


def _tail(path: str) -> list:
    if not path:
        return []
    try:
        with Path(path).open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL_BYTES))
            return f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return []


class _Forked:
    """A forked training process's status in Popen's convention (`returncode`: -N for a signal
    N), from torch's multiprocessing Process (trainer/forked.py)."""

    def __init__(self, process):
        self.process = process

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode


def _status_of(pcontext, local_rank: int):
    """What tells a process's status once torchrun has reaped it: the Popen of an exec'd one,
    the Process of a forked one (trainer/forked.py); None when torch names neither."""
    handlers = getattr(pcontext, "subprocess_handlers", None) or {}
    if local_rank in handlers:
        return getattr(handlers[local_rank], "proc", None)
    processes = getattr(getattr(pcontext, "_pc", None), "processes", None) or []
    return _Forked(processes[local_rank]) if local_rank < len(processes) else None


@contextlib.contextmanager
def watching(watch: ExitWatch):
    """Within the block, torchrun's launcher (`torch.distributed.run.run`) builds its agent from
    a LocalElasticAgent subclass that reports to `watch`; where torch lacks the names this relies
    on, nothing changes (the records then come from torchrun's ProcessFailures)."""
    try:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        from torch.distributed.launcher import api
    except ImportError:
        yield
        return
    if getattr(api, "LocalElasticAgent", None) is not LocalElasticAgent or not hasattr(
            os, "waitid"):
        yield
        return

    class WatchedAgent(LocalElasticAgent):
        def _start_workers(self, worker_group):
            pids = super()._start_workers(worker_group)
            pcontext = getattr(self, "_pcontext", None)
            stderrs = getattr(pcontext, "stderrs", None) or {}
            watch.watch(worker_group.group_rank or 0, [
                (w.global_rank, w.local_rank, pids[w.local_rank], stderrs.get(w.local_rank),
                 _status_of(pcontext, w.local_rank))
                for w in worker_group.workers])
            return pids

        def _monitor_workers(self, worker_group):
            # Look before torchrun does: it reaps what has ended, then, finding a failure, stops
            # the rest; what ends after this look was stopped
            looked = watch.check()
            try:
                result = super()._monitor_workers(worker_group)
            except BaseException:  # a signal came while it looked, or while it stopped them
                watch.stopping(looked)
                raise
            if result.is_failed():
                watch.stopping(looked)
            return result

        def _shutdown(self, *args, **kwargs):
            watch.stopping()
            return super()._shutdown(*args, **kwargs)

    api.LocalElasticAgent = WatchedAgent
    try:
        yield
    finally:
        api.LocalElasticAgent = LocalElasticAgent
        watch.close()
