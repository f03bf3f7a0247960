"""Exit codes, chosen so that a PyTorchJob's `restartPolicy: ExitCode` does the right thing.

The Training Operator treats exit codes 1-127 as permanent (the job fails at once) and 128-255 as
retryable (the pod is recreated, up to `runPolicy.backoffLimit` times). So:

| code | meaning | who decides | operator |
|---|---|---|---|
| 0 | success | | done |
| 1 | unexpected error (a bug): Python's own code for an uncaught exception | Python | fails |
| 2 | bad input or parameters (`KfvisionError`) | trainer | fails |
| 3 | the loss became NaN/Inf (`NonFiniteLossError`) | trainer | fails |
| 4 | the output location is read-only or full (`OutputError`) | trainer | fails |
| 69 | a server did not answer (`EndpointUnreachableError`): retrying may help | command line | |
| 76 | TLS with a server failed (`EndpointTLSError`): fix the certificate first | command line | |
| 77 | a server refused the credentials (`EndpointAuthError`): fix them first | command line | |
| 128+N | killed by signal N: 137 SIGKILL (OOM killer), 143 SIGTERM | kernel, launcher | retried |
| 200 | lost a peer: a collective or the rendezvous failed or timed out | trainer | retried |

(134 = SIGABRT is how the NCCL watchdog ends a process stuck on a dead peer; 143 = SIGTERM is what
a deleted, evicted or preempted pod gets.)

`torchrun` alone would hide all of this: any failed training process makes it exit 1. So the
container runs `python -m kfvision.trainer.launch` (torchrun's own code, see `trainer/launch.py`),
which maps its children's exit codes and signals back with `for_failures` below. A retried pod
resumes from the last checkpoint (`trainer/checkpoint.py`), so a retry costs at most one epoch.
"""

import re
import signal

EXIT_BUG = 1
EXIT_INPUT = 2
EXIT_NONFINITE = 3
EXIT_OUTPUT = 4
# The command line's talks with servers (pipelines/clients/endpoints.py), after sysexits.h
EXIT_UNAVAILABLE = 69
EXIT_TLS = 76
EXIT_AUTH = 77
EXIT_SIGNAL_BASE = 128
EXIT_PEER_LOST = 200

# Messages of torch.distributed failures that are not (yet) DistError subclasses: gloo raises a
# plain RuntimeError when a peer's socket closes, e.g. "[...gloo/transport/tcp/pair.cc:545] Read
# error [127.0.0.1]:62605: Connection reset by peer".
_PEER_LOST_MARKERS = ("gloo/transport", "connection reset by peer", "connection closed by peer",
                      "connection refused", "broken pipe", "nccl", "timed out", "socket timeout",
                      "processgroup", "c10d")
# A DataLoader worker killed under us: the OOM killer or an eviction, as for the pod itself.
_WORKER_KILLED_MARKERS = ("dataloader worker (pid", "killed by signal", "exited unexpectedly")


def is_retryable(code: int) -> bool:
    """Whether the operator's ExitCode policy retries a container that exited with `code`."""
    return 128 <= code <= 255


def describe(code: int) -> str:
    """A few words on what an exit code means here (for logs and the docs)."""
    if code == 0:
        return "success"
    if code >= EXIT_SIGNAL_BASE and code != EXIT_PEER_LOST and code - 128 < 65:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = f"signal {code - 128}"
        return f"killed by {name}: retried"
    return {EXIT_BUG: "unexpected error: permanent", EXIT_INPUT: "bad input: permanent",
            EXIT_NONFINITE: "non-finite loss: permanent", EXIT_OUTPUT: "output not writable: "
            "permanent", EXIT_PEER_LOST: "lost a peer: retried",
            EXIT_UNAVAILABLE: "server unreachable: retrying may help",
            EXIT_TLS: "TLS failed: fix the certificate first",
            EXIT_AUTH: "credentials refused: fix them first"}.get(
                code, "retried" if is_retryable(code) else "permanent")


def error_line(exc: BaseException, text: str | None = None) -> str:
    """The line a command prints when it stops on `exc`: `error: <ErrorName>: <message>` (`text`:
    the message as this front end words it; str(exc) by default). The name is what users search
    a log for and what docs/faults.md lists."""
    return f"error: {type(exc).__name__}: {exc if text is None else text}"


def for_exception(exc: BaseException) -> int | None:
    """The exit code for an exception that reached the top of a training process, or None when
    it is unexpected (then Python's traceback and exit code 1 are the right answer)."""
    from kfvision.trainer.errors import KfvisionError

    if isinstance(exc, KfvisionError):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_SIGNAL_BASE + signal.SIGINT
    if _is_peer_failure(exc):
        return EXIT_PEER_LOST
    return None


def _is_peer_failure(exc: BaseException) -> bool:
    try:
        from torch.distributed import DistError
    except ImportError:  # a torch built without distributed support
        DistError = ()  # noqa: N806
    if DistError and isinstance(exc, DistError):
        return True
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if type(exc) is RuntimeError:
        text = str(exc).lower()
        return any(m in text for m in _PEER_LOST_MARKERS + _WORKER_KILLED_MARKERS)
    return False


# torch.distributed's errors (DistError and its subclasses) and Python's connection errors, by
# the name a traceback's last line gives them
_PEER_LOST_TYPES = re.compile(r"(torch\.distributed\.)?Dist\w*Error|\w*Connection\w*Error|"
                              r"BrokenPipeError|TimeoutError")


def is_peer_lost(type_name: str, message: str) -> bool:
    """Whether an error another process printed (its traceback's last line: `type_name`,
    `message`) is a lost peer, as `for_exception` would map it: a DistError, a connection error
    or timeout, or a RuntimeError with gloo's or NCCL's words for a peer that went away. A
    DataLoader worker killed under it is not: that process failed by itself."""
    if _PEER_LOST_TYPES.fullmatch(type_name):
        return True
    return type_name == "RuntimeError" and any(m in message.lower() for m in _PEER_LOST_MARKERS)


def for_failures(failures) -> int:
    """One exit code for a node from its failed training processes.

    Args:
        failures: (exitcode, timestamp) pairs; a signal N as torchrun gives it (-N) or as a
            container reports it (128 + N).
    Returns:
        A permanent code (1-127) if any process failed permanently: the first such (bad input on
        one rank is bad input, even if torchrun then had to SIGTERM the others); else the first
        failure's code, signals as 128 + N (always retryable).
    """
    failures = sorted(failures, key=lambda f: f[1])
    if not failures:
        return EXIT_BUG
    permanent = [code for code, _ in failures if 0 < code < 128]
    if permanent:
        return permanent[0]
    code = failures[0][0]
    if code < 0:
        return min(255, EXIT_SIGNAL_BASE - code)
    return code if is_retryable(code) else EXIT_BUG
