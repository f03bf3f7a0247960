"""What the boot gives each process of a user's script beside torchrun's variables, and what it
learns back: the rank hook (pipelines/script/rankhook/sitecustomize.py) merges the process's
stderr into its stdout, defines Azure ML's `AZ_BATCHAI_*` and expands `$NAME` in the script's
arguments, and marks the processes that joined a process group.

Azure ML v1's names (Azure ML docs, "Train PyTorch models at scale", the DDP configuration's
`--dist-url $AZ_BATCHAI_PYTORCH_INIT_METHOD --rank $AZ_BATCHAI_TASK_INDEX`):
AZ_BATCHAI_PYTORCH_INIT_METHOD is an init method that works under kfvision's launchers (`env://`:
MASTER_ADDR and MASTER_PORT are set; under torchrun the ranks meet at its store);
AZ_BATCHAI_TASK_INDEX is the process's global rank (RANK), set by the hook.
"""

import os
from pathlib import Path

HOOK_DIR = Path(__file__).parent / "rankhook"
RANK_HOOK, GROUP_MARKS = "KFVISION_RANK_HOOK", "KFVISION_GROUP_MARKS"  # the hook's names
AZ_INIT_METHOD, AZ_TASK_INDEX = "AZ_BATCHAI_PYTORCH_INIT_METHOD", "AZ_BATCHAI_TASK_INDEX"
INIT_METHOD = "env://"


def rank_env(env: dict, marks: Path) -> dict:
    """`env` (the script's) with the hook on PYTHONPATH (last: the user's modules come first),
    its switch, the folder of its marks (emptied) and Azure's init method (unless given)."""
    if marks.exists():
        for f in marks.iterdir():
            f.unlink()
    marks.mkdir(parents=True, exist_ok=True)
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(HOOK_DIR)]))
    env.update({RANK_HOOK: "1", GROUP_MARKS: str(marks)})
    env.setdefault(AZ_INIT_METHOD, INIT_METHOD)
    return env


def alone_line(marks: Path, processes: int) -> str | None:
    """The summary line of a job of `processes` (> 1) where no process of this pod joined a
    process group, each having run the whole script on its own; else None."""
    if processes <= 1 or any(marks.iterdir()):
        return None
    return (f"{processes} processes each ran the whole script: none joined a process group "
            "(torch.distributed.init_process_group), so each trained on its own; see "
            "docs/scripts.md, \"Logs\"")
