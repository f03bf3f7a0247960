"""`kfvision train`: the trainer core's flags, in one process or several (torchrun)."""

import os
import subprocess
import sys

from trainer.options import HelpFormatter

HELP = "train a model (one process, or N with --nproc-per-node)"
NPROC_FLAG = "--nproc-per-node"
LOOPBACK = "127.0.0.1"


def _train(args) -> int:
    from trainer import train

    rest = _without_option(args.argv[1:], NPROC_FLAG)  # the trainer's own flags, as given
    nproc = args.nproc_per_node
    if nproc == 1:
        return train.main(rest)
    # Several processes on this machine: hand over to torchrun, exactly as a PyTorchJob would
    # (through trainer.launch, which keeps the training processes' exit codes). One machine needs
    # no host name: the processes meet on loopback. Without --local-addr torchrun hands them
    # this host's name, and where it does not resolve (a container's hostname missing from its
    # /etc/hosts) they wait for the rendezvous timeout, then fail.
    cmd = [sys.executable, "-m", "trainer.launch", "--standalone", f"--local-addr={LOOPBACK}",
           f"--nproc-per-node={nproc}", "-m", "trainer.train", *rest]
    return subprocess.call(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _without_option(argv: list, flag: str) -> list:
    """argv less `flag VALUE` / `flag=VALUE` (what kfvision adds on top of the trainer's flags)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def register(sub, argv: list) -> None:
    """Add `kfvision train` (the trainer's own parser as its parent); `argv`: the whole command
    line, handed on to the trainer."""
    from trainer.config import get_args_parser

    t = sub.add_parser("train", parents=[get_args_parser(add_help=False)], help=HELP,
                       description="Train with DDP. Same flags as `python -m trainer.train` "
                       "(the torchrun entrypoint).",
                       formatter_class=HelpFormatter)
    t.add_argument(NPROC_FLAG, type=int, default=1,
                   help="processes on this machine (starts torchrun --standalone when > 1)")
    t.set_defaults(func=_train, argv=argv)
