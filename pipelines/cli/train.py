"""`kfvision train`: the trainer core's flags, in one process or several (torchrun)."""

import os
import subprocess
import sys

from kfvision.trainer.options import HelpFormatter

NPROC_FLAG = "--nproc-per-node"  # torchrun's spelling, as `kfvision job render` has it
LOOPBACK = "127.0.0.1"


def _train(args) -> int:
    from kfvision.pipelines.jobs.config import train_flags
    from kfvision.trainer.config import config_from_args
    from kfvision.trainer.inputs import read_inputs

    # The trainer's flags are written from the parsed, checked configuration (--config
    # merged in): what reaches the trainer is what kfvision's parser understood, never a
    # filtered copy of the command line. Flags and inputs are checked before torch is imported
    # (trainer/inputs.py): a mistake is said at once, and with several processes this one only
    # waits for torchrun. The manifests only: the trainer itself looks at every image file
    # (200,000 stats take seconds).
    cfg = config_from_args(args)
    read_inputs(cfg.model, cfg.train, cfg.val, verify="none")
    flags = train_flags(cfg)
    nproc = args.nproc_per_node
    if nproc == 1:
        from kfvision.trainer import train

        return train.main(flags)
    # Several processes on this machine: hand over to torchrun, exactly as a PyTorchJob would
    # (through kfvision.trainer.launch, which keeps the training processes' exit codes). One machine
    # needs no host name: the processes meet on loopback. Without --local-addr torchrun hands them
    # this host's name, and where it does not resolve (a container's hostname missing from its
    # /etc/hosts) they wait for the rendezvous timeout, then fail.
    cmd = [sys.executable, "-m", "kfvision.trainer.launch", "--standalone",
           f"--local-addr={LOOPBACK}",
           f"{NPROC_FLAG}={nproc}", "-m", "kfvision.trainer.train", *flags]
    return subprocess.call(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def register(sub, help: str) -> None:
    """Add `kfvision train` (the trainer's own parser as its parent)."""
    from kfvision.trainer.config import get_args_parser

    t = sub.add_parser("train", parents=[get_args_parser(add_help=False)], help=help,
                       description="Train with DDP. Same flags as `python -m "
                       "kfvision.trainer.train` (the torchrun entrypoint).",
                       formatter_class=HelpFormatter)
    t.add_argument(NPROC_FLAG, type=int, default=1,
                   help="processes on this machine (torchrun --standalone when > 1)")
    t.set_defaults(func=_train)
