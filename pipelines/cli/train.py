"""`kfvision train`: the trainer core's flags, in one process or several (torchrun)."""

import os
import subprocess
import sys

from kfvision.pipelines.cli.flags import NPROC_FLAG
from kfvision.trainer.options import HelpFormatter

LOOPBACK = "127.0.0.1"


def _train(args) -> int:
    from kfvision.pipelines.jobs.config import train_flags
    from kfvision.pipelines.jobs.storejob import check_store, uses_store
    from kfvision.trainer.config import config_from_args
    from kfvision.trainer.inputs import read_inputs

    # The trainer's flags are written from the parsed, checked configuration (--config
    # merged in): what reaches the trainer is what kfvision's parser understood, never a
    # filtered copy of the command line. Flags and inputs are checked before torch is imported
    # (trainer/inputs.py): a mistake is said at once, and with several processes this one only
    # waits for torchrun. The manifests only: the trainer itself looks at every image file
    # (200,000 stats take seconds).
    cfg = config_from_args(args)
    nproc = args.nproc_per_node
    if uses_store(cfg):
        check_store(cfg)
        return _train_from_store(train_flags(cfg), nproc, args.scratch)
    read_inputs(cfg.model, cfg.train, cfg.val, verify="none")
    flags = train_flags(cfg)
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


def _train_from_store(flags: list, nproc: int, scratch: str | None) -> int:
    """s3:// data, model or output: the node agent (pipelines/jobs/storenode.py) as one node of
    `nproc` processes, as a pod of a job runs it, with `scratch` (kept) or a temporary folder
    (removed after) as its scratch disk."""
    import tempfile

    from kfvision.pipelines import contract
    from kfvision.pipelines.clients.endpoints import free_port
    from kfvision.pipelines.jobs.trainjob.rules import PET_NAMES

    with tempfile.TemporaryDirectory(prefix="kfvision-scratch-") as tmp:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", contract.SCRATCH_ENV: scratch or tmp,
               **dict(zip(PET_NAMES, ("1", str(nproc), "0", LOOPBACK, str(free_port())),
                          strict=True))}
        env.pop(contract.POD_ROOT, None)
        return subprocess.call([sys.executable, "-m", contract.STORE_COMMAND[-1], *flags],
                               env=env)


def register(sub, help: str) -> None:
    """Add `kfvision train` (the trainer's own parser as its parent)."""
    from kfvision.trainer.config import get_args_parser

    t = sub.add_parser("train", parents=[get_args_parser(add_help=False)], help=help,
                       description="Train with DDP. Same flags as `python -m "
                       "kfvision.trainer.train` (the torchrun entrypoint).",
                       formatter_class=HelpFormatter)
    t.add_argument(NPROC_FLAG, type=int, default=1,
                   help="processes on this machine (torchrun --standalone when > 1)")
    t.add_argument("--scratch", metavar="DIR",
                   help="where s3:// data is fetched to (default: a temporary folder)")
    t.set_defaults(func=_train)
