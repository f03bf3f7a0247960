"""Ctrl-C, SIGTERM and a closed terminal (SIGHUP) for `run-local`: heard however it was started,
acted on at a safe moment.

`run-local` is the parent of every process of a local job. Each replica runs in a session of its
own, so the terminal's Ctrl-C (and a `kill` of `run-local`) reaches `run-local` alone, which must
then stop them all. Two things made that fail (docs/faults.md, "Stopping a local job"):

- **Inherited dispositions.** A program starts with the signals its parent ignored still ignored
  (SIG_IGN survives exec) and with its parent's signal mask; CPython installs its
  KeyboardInterrupt handler only when SIGINT is at its default. A non-interactive shell starts a
  command run with `&` with SIGINT ignored (POSIX, "Asynchronous Lists"): a test suite started in
  the background, a script, some CI steps. Every process started from there inherits it, the
  `run-local` a test starts too, and that one never heard a Ctrl-C. So `STOP` installs its
  handlers whatever was inherited, and unblocks the signals.
- **A handler that raises.** CPython runs a handler in the main thread between two bytecodes, so
  the default one raises KeyboardInterrupt anywhere: inside `Popen()` after the fork (a replica
  runs that was never recorded, so never stopped), inside `Popen.poll()` holding its lock, or in
  the middle of stopping. `STOP`'s handler only records the signal; the supervising loops `check`
  it (at most 0.1 s later, between two steps) and raise there.

A signal that comes while the processes are being stopped means "now": SIGKILL at once rather
than the grace period (`kfvision.pipelines.jobs.procs.stop_all`).

SIGHUP (the terminal or the SSH session closed) stops the job as SIGTERM does: its default would
end `run-local` alone and leave the replicas, each in a session of its own, training on with no
one to stop them. One difference: SIGHUP inherited ignored stays ignored, since that is what
`nohup` is asked for (keep running after the terminal closes); nothing ignores SIGHUP by accident.
"""

import contextlib
import signal
import threading
import time

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _nohup(signum: int) -> bool:
    """SIGHUP ignored by whoever started this process (`nohup`): leave it so."""
    return signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN


class Interrupted(KeyboardInterrupt):
    """`run-local` was told to stop by `signum` (SIGINT: Ctrl-C; SIGTERM: `kill`, a cancelled
    pipeline step, a deleted pod; SIGHUP: the terminal closed). A KeyboardInterrupt, so that
    callers that stop on Ctrl-C stop."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequests(contextlib.ContextDecorator):
    """The SIGINT, SIGTERM and SIGHUP received while `with STOP:` (or a function decorated
    `@STOP`) runs, in order.

    Entering (in the main thread: only it may set handlers) installs the recording handler and
    unblocks the signals (SIGHUP's only where it was not inherited ignored: `nohup`); leaving the
    outermost `with` puts back what was there. Entered from another thread it does nothing: that
    caller's own signal handling stays in charge.
    """

    def __init__(self):
        self.received: list = []
        self._depth, self._previous, self._mask = 0, {}, set()

    def _record(self, signum, frame) -> None:
        self.received.append(signum)

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            if self._depth == 0:
                self.received = []
                self._previous = {s: signal.signal(s, self._record) for s in STOP_SIGNALS
                                  if not _nohup(s)}
                self._mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
            self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._depth -= 1
        if self._depth == 0:
            for s, previous in self._previous.items():
                # None: a handler set outside Python; the default is the nearest we can give back
                signal.signal(s, signal.SIG_DFL if previous is None else previous)
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)

    def check(self) -> None:
        """Raise Interrupted (of the first signal) once SIGINT, SIGTERM or SIGHUP came."""
        if self.received:
            raise Interrupted(self.received[0])

    def sleep(self, seconds: float) -> None:
        """time.sleep that ends at once, with Interrupted, when a stop signal comes."""
        end = time.monotonic() + seconds
        while True:
            self.check()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.1))


STOP = StopRequests()  # signal handlers belong to the process: there is one
