"""`torchrun` that keeps its training processes' exit codes: the container entrypoint.

    python -m kfvision.trainer.launch [torchrun flags] -m kfvision.trainer.train [training flags]

Same flags, same `PET_*` environment and same behaviour as `torchrun` (this *is* torchrun's code:
`torch.distributed.run.parse_args` and `run`), except how it exits, and that its tee (`--tee`)
copies every line a training process wrote, its last ones included (trainer/taillog.py).
torchrun ends with exit code 1 whatever went wrong: bad input on one rank, a rank killed by the
OOM killer, a lost peer and a rendezvous timeout all look alike, so a PyTorchJob's
`restartPolicy: ExitCode` would treat every one as permanent. Here:

- a training process failed: the node exits with `exitcodes.for_failures` of all its processes
  (a permanent code wins; a signal N becomes 128 + N);
- torchrun itself got SIGTERM/SIGINT/SIGHUP (pod deleted, evicted, preempted): 128 + N;
- the rendezvous failed (peer never came, store unreachable, timeout): 200, retried;
- anything else (e.g. bad launcher flags): 1, with torchrun's traceback.

Before it exits after a failure it prints one line per process that did not succeed, stamped to
the microsecond, and one naming the node's first failure (`FAILED: rank 3 on node 1 exited with
1 (...) after 11.2 s; stopped: rank 2 on node 1`): trainer/failures.py and trainer/exitwatch.py.

Keep torchrun's `--max-restarts` at 0 (its default) in a PyTorchJob: it would retry bad input as
eagerly as a lost peer, and with several nodes only the operator can restart them together.
See docs/faults.md for the whole picture.
"""

import contextlib
import signal
import sys
import time

from kfvision.trainer import exitcodes, failures, forked, taillog
from kfvision.trainer.exitwatch import ExitWatch, watching

PREFIX = "[kfvision launch]"


def _say(text: str) -> None:
    # one write, line break included (print makes two): torchrun's tee threads write the ranks'
    # lines into the same pipe, and would glue one onto a line cut before its break
    sys.stderr.write(f"{PREFIX} {text}\n")
    sys.stderr.flush()


def _say_records(watch, started: float, torch_failures=None) -> list:
    """One line per training process that did not succeed (trainer/failures.py), then the
    FAILED line naming this node's first failure; the records."""
    records = watch.records(started, torch_failures)
    for r in records:
        _say(r.line())
    verdict = failures.order(records)
    if verdict is not None:
        _say(f"FAILED: {verdict.summary()}")
    return records


def _failure_summary(err, watch, started: float) -> int:
    """Exit code for torchrun's ChildFailedError (`exitcodes.for_failures` of its processes, in
    the order they ended), after the records and the FAILED line."""
    records = _say_records(watch, started, err.failures)
    code = exitcodes.for_failures([(r.code, r.at) for r in records])
    _say(f"exiting with {code}: {exitcodes.describe(code)}")
    return code


def main(argv=None, args=None) -> int:
    """Run torchrun with `argv` (or `args`, already parsed by torchrun's parser); returns the
    exit code for the container (see module doc)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    if args is None:
        args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    fork = forked.forks(args)
    if fork:
        import kfvision.trainer.train  # noqa: F401  (what each forked process runs)
    watch, started = ExitWatch(), time.time()
    try:
        with taillog.every_line(), watching(watch), (
                forked.forking(torchrun) if fork else contextlib.nullcontext()):
            torchrun.run(args)
    except ChildFailedError as e:
        _hold_signals()
        return _failure_summary(e, watch, started)
    except SignalException as e:
        _hold_signals()
        _say_records(watch, started)  # what had failed before the signal came
        code = exitcodes.EXIT_SIGNAL_BASE + int(e.sigval)
        _say(f"got {e.sigval.name}: stopped the training processes; exiting with {code} "
             "(retried: the pod resumes from the last checkpoint)")
        return code
    except (RendezvousError, ConnectionError, TimeoutError) as e:
        return _peer_lost(e)
    except RuntimeError as e:
        if exitcodes.for_exception(e) == exitcodes.EXIT_PEER_LOST:  # DistStoreError & co.
            return _peer_lost(e)
        raise
    return 0


def _hold_signals() -> None:
    """torchrun's handlers stay after it returns and raise SignalException wherever the launcher
    is: a SIGTERM now (the pod deleted, run-local stopping the job) would cut the summary short
    with a traceback. Its processes are gone; the summary takes milliseconds."""
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)


def _peer_lost(e: BaseException) -> int:
    _say(f"rendezvous failed ({type(e).__name__}: {e}); exiting with {exitcodes.EXIT_PEER_LOST} "
         "(retried: the other nodes may not be up yet, or one was lost)")
    return exitcodes.EXIT_PEER_LOST


if __name__ == "__main__":
    from torch.distributed import run  # main's imports, made before the freeze

    from kfvision.trainer.heap import freeze_at_exit, freeze_imports

    freeze_at_exit()  # also when parsing ends the program (--help, a bad flag)
    parsed = run.parse_args(sys.argv[1:])
    if forked.forks(parsed):  # what each forked process runs, imported before the freeze
        import kfvision.trainer.train  # noqa: F401
    freeze_imports()
    sys.exit(main(args=parsed))
