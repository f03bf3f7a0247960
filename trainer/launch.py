"""`torchrun` that keeps its training processes' exit codes: the container entrypoint.

    python -m kfvision.trainer.launch [torchrun flags] -m kfvision.trainer.train [training flags]

Same flags, same `PET_*` environment and same behaviour as `torchrun` (this *is* torchrun's code:
`torch.distributed.run.parse_args` and `run`), except how it exits. torchrun ends with exit code 1
whatever went wrong: bad input on one rank, a rank killed by the OOM killer, a lost peer and a
rendezvous timeout all look alike, so a PyTorchJob's `restartPolicy: ExitCode` would treat every
one as permanent. Here:

- a training process failed: the node exits with `exitcodes.for_failures` of all its processes
  (a permanent code wins; a signal N becomes 128 + N);
- torchrun itself got SIGTERM/SIGINT/SIGHUP (pod deleted, evicted, preempted): 128 + N;
- the rendezvous failed (peer never came, store unreachable, timeout): 200, retried;
- anything else (e.g. bad launcher flags): 1, with torchrun's traceback.

Keep torchrun's `--max-restarts` at 0 (its default) in a PyTorchJob: it would retry bad input as
eagerly as a lost peer, and with several nodes only the operator can restart them together.
See docs/faults.md for the whole picture.
"""

import sys
import time

from kfvision.trainer import exitcodes

PREFIX = "[kfvision launch]"


def _say(text: str) -> None:
    print(f"{PREFIX} {text}", file=sys.stderr, flush=True)


def _failure_summary(err, node_rank=None, started: float | None = None) -> int:
    """Exit code for torchrun's ChildFailedError, with one line per failed process, then one
    line naming the first failure: rank, node, code, how long after the start."""
    failures = err.failures  # global rank -> ProcessFailure
    code = exitcodes.for_failures([(f.exitcode, f.timestamp) for f in failures.values()])
    for rank, f in sorted(failures.items()):
        how = (f"was killed by {f.signal_name()}" if f.exitcode < 0
               else f"exited with {f.exitcode} ({exitcodes.describe(f.exitcode)})")
        _say(f"rank {rank} (local rank {f.local_rank}, pid {f.pid}) {how}")
    if failures and started is not None:
        rank, first = min(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
        own = first.exitcode if first.exitcode > 0 else exitcodes.EXIT_SIGNAL_BASE - first.exitcode
        _say(f"FAILED: rank {rank} on node {node_rank} exited with {own} "
             f"({exitcodes.describe(own)}) after {max(0.0, first.timestamp - started):.0f} s")
    _say(f"exiting with {code}: {exitcodes.describe(code)}")
    return code


def main(argv=None) -> int:
    """Run torchrun with `argv`; returns the exit code for the container (see module doc)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    started = time.time()  # ProcessFailure.timestamp is wall-clock seconds
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        return _failure_summary(e, args.node_rank, started)
    except SignalException as e:
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


def _peer_lost(e: BaseException) -> int:
    _say(f"rendezvous failed ({type(e).__name__}: {e}); exiting with {exitcodes.EXIT_PEER_LOST} "
         "(retried: the other nodes may not be up yet, or one was lost)")
    return exitcodes.EXIT_PEER_LOST


if __name__ == "__main__":
    from kfvision.trainer.heap import freeze_imports
    from torch.distributed import run  # noqa: F401  (main's imports, made before the freeze)

    freeze_imports()
    sys.exit(main())
