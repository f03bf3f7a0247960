"""The built-in trainer's processes started by `fork` from the launcher, which has imported it once.

A training process that torchrun starts as `python -u -m kfvision.trainer.train` pays for a new
interpreter before its first step: importing torch, torchvision and the `torch._dynamo` that
torchvision's ops import costs 3.5-4.5 CPU-seconds, a node of N processes N times over (the
figures: docs/development.md, "Where the suite's time goes"). kfvision's launcher
(trainer/launch.py) imports the trainer once instead and has torchrun start each process as a
function in a forked copy of itself (torchrun's own `MultiprocessContext`, start method "fork"):
0.5 CPU-seconds to its first step. Same flags, same environment, same logs and exit codes:

- each process runs what `python -m kfvision.trainer.train ARGV` runs (`train.main`), with the
  signal handlers a new interpreter has (torchrun's own, inherited, would turn a SIGTERM into an
  exception), unbuffered lines as `-u` gives, and a traceback and exit code 1 for a bug;
- its name (/proc/PID/comm, what `ps` and `top` show) is RANK_NAME with its local rank, and
  `local_rank_of` reads it: a forked process's LOCAL_RANK is set after the fork, so another
  process cannot read it from /proc/PID/environ as it can an exec'd one's.

Only where no GPU device is present: CUDA (and ROCm) must not be initialised in a process that
then forks, and torchrun's `--nproc-per-node gpu|auto` asks CUDA. There, and for every other
program (a user's script, `--no-python`, `--run-path`), torchrun execs as before.
"""

import contextlib
import ctypes
import os
import signal
import sys
import traceback
from pathlib import Path

TRAINER_MODULE = "kfvision.trainer.train"
RANK_NAME = "kfvision-lr{}"  # a forked training process's name: 15 bytes at most (comm)
_PR_SET_NAME = 15  # prctl(2)
TORCHELASTIC_SIGNALS = "TORCHELASTIC_SIGNALS_TO_HANDLE"
TORCHELASTIC_SIGNALS_DEFAULT = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def forks(args) -> bool:
    """Whether torchrun's parsed `args` start the built-in trainer, forked (module doc)."""
    return (bool(args.module) and args.training_script == TRAINER_MODULE
            and not args.no_python and not args.run_path and hasattr(os, "fork")
            and not accelerator_devices())


def accelerator_devices(dev: Path = Path("/dev")) -> bool:
    """Whether this machine shows its containers a GPU: NVIDIA's /dev/nvidiaN, AMD's /dev/kfd."""
    return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists()


@contextlib.contextmanager
def forking(torchrun):
    """Within the block, `torchrun.run(args)` starts the built-in trainer as `train` in forked
    processes: its LaunchConfig, rendezvous and logs are torchrun's own, only the entrypoint and
    the start method change."""
    original = torchrun.config_from_args

    def config_from_args(args):
        config, _, _ = original(args)
        config.start_method = "fork"
        return config, train, list(args.training_script_args)

    torchrun.config_from_args = config_from_args
    try:
        yield
    finally:
        torchrun.config_from_args = original


def train(*argv: str) -> None:
    """One training process, forked from the launcher: `python -u -m kfvision.trainer.train
    ARGV` without a new interpreter (module doc). Ends by SystemExit with the trainer's code."""
    _default_signals()
    name_process(RANK_NAME.format(os.environ.get("LOCAL_RANK", "")))
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True, write_through=True)
    from kfvision.trainer import train as trainer

    sys.argv = [trainer.__file__, *argv]
    try:
        code = trainer.main(list(argv))
    except Exception:  # a bug: its traceback and exit code 1, as `python -m` would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _default_signals() -> None:
    """Give back what a new interpreter has for each signal torchrun's agent took in the launcher
    (its handler raises SignalException): the default action, and KeyboardInterrupt for SIGINT.
    Which signals: TORCHELASTIC_SIGNALS_TO_HANDLE, read as torch 2.14 reads it (its default
    there: torch/distributed/elastic/multiprocessing/api.py, PContext.start)."""
    names = os.environ.get(TORCHELASTIC_SIGNALS, TORCHELASTIC_SIGNALS_DEFAULT).split(",")
    for name in names:
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)


def name_process(name: str) -> None:
    """Set this process's name (/proc/PID/comm), where Linux has prctl; else nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def local_rank_of(pid: int) -> int | None:
    """The LOCAL_RANK of process `pid` as another process sees it: from its environment (a
    process torchrun exec'd, and every process that one starts), else from its name (a process
    this launcher forked, and its own forked children: DataLoader workers); None when neither
    says, or it is gone."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read
        return None
    for item in env:
        if item.startswith(b"LOCAL_RANK="):
            return int(item.split(b"=", 1)[1])
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    prefix = RANK_NAME.format("")
    tail = comm.removeprefix(prefix)
    return int(tail) if comm.startswith(prefix) and tail.isdigit() else None
