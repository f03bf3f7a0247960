"""What a script job's boot prepares before the script runs (pipelines/script/boot.py): its
python (the requirements' environments), its path (a `src/` project's package folder) and
Accelerate's CPU switch. Each step says what it did through `say`, the boot's log line.

    python = install(requirements_file(args, src, files), src, work, say)
    script_path(args, env, files, src, cwd, say)
    cpu_accelerate(args, env, python, say)
"""

import os
import subprocess
import sys
from pathlib import Path

from kfvision.pipelines import contract
from kfvision.pipelines.script.snapshot import InvalidSourceError

# Accelerate's switch to its CPU path (huggingface/accelerate src/accelerate/state.py,
# PartialState.__init__: parse_flag_from_env("ACCELERATE_USE_CPU"))
ACCELERATE_CPU = "ACCELERATE_USE_CPU"
LOCAL_ENV = "local-env"  # under the pod's WORK: this job's own packages (env.local_layer)


def requirements_file(args, src: Path, files) -> Path | None:
    """The requirements file of the job: --requirements, else pipelines/script/entry.py's
    default (beside the entry, else at the source's root), else None."""
    from kfvision.pipelines.script.entry import default_requirements

    if args.requirements:
        path = src / args.requirements
        if not path.is_file():
            raise InvalidSourceError(f"--requirements {args.requirements} is not a file of the "
                                     "source snapshot.")
        return path
    found = default_requirements(files, args.entry)
    return None if found is None else src / found


def install(requirements: Path | None, src: Path, work: Path, say) -> Path:
    """The script's python: this interpreter, or the requirements' environments (the cached
    third-party one, and on top this job's own packages from the snapshot: pipelines/script/
    env.py)."""
    python = Path(sys.executable)
    if requirements is None:
        say("requirements: none (no --requirements, no requirements.txt beside the entry or at "
            "the source's root)")
        return python
    from kfvision.pipelines.script import requirements as reqfile
    from kfvision.pipelines.script.env import ensure_env, local_layer

    reqs = reqfile.read(requirements, src)
    what = str(requirements.relative_to(src))
    if reqs.third_party:
        python = ensure_env(reqs, env_cache(work), what, say=say)
    else:
        say(f"requirements: {what}: no third-party package")
    if reqs.local:
        python = local_layer(reqs, python if reqs.third_party else None, work / LOCAL_ENV,
                             requirements.parent, what, say=say)
    return python


def env_cache(work: Path) -> Path:
    """The requirements cache: contract.ENV_CACHE, else the user's cache folder, else (a
    read-only root, no home) the pod's WORK."""
    given = os.environ.get(contract.ENV_CACHE)
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):  # a uid without a home (no HOME, no passwd entry)
        return work / "envs"
    home = Path(base) / "kfvision" / "envs"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:  # a pod's read-only root filesystem: the environment lives with the pod
        pass
    return work / "envs"


def script_path(args, env: dict, files, src: Path, cwd: Path, say) -> None:
    """PYTHONPATH of the script's processes: for `-m`, the source's root when it runs elsewhere
    (--workdir); for both, a `src/` project's package folder (pipelines/script/entry.py
    module_roots), so that its packages import from the snapshot as an install would."""
    from kfvision.pipelines.script.entry import module_roots, package_folder

    roots = module_roots(files, args.workdir) if args.module else \
        [r for r in [package_folder(files)] if r]
    extra = [str(src / r) for r in roots if (src / r).resolve() != cwd.resolve()]
    if extra:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*extra, env.get("PYTHONPATH")]))
        say(f"on the script's path: {', '.join(extra)} (from the snapshot)")


def uses_accelerate(python: Path) -> bool:
    """Whether the script's python can import Accelerate (Hugging Face's Trainer runs on it)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('accelerate') is None)"
    return subprocess.run([str(python), "-I", "-c", probe], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def cpu_accelerate(args, env: dict, python: Path, say) -> None:
    """ACCELERATE_USE_CPU=true in a pod without GPUs, unless the job sets it: Accelerate with
    no GPU starts gloo but reports DistributedType.NO unless told to use the CPU, so N processes
    would train N models alone (docs/scripts.md "Hugging Face's Trainer")."""
    if args.gpus or ACCELERATE_CPU in env or not uses_accelerate(python):
        return
    env[ACCELERATE_CPU] = "true"
    say(f"{ACCELERATE_CPU}=true: no GPU in the pod, so Accelerate (and Hugging Face's Trainer) "
        f"trains one model across the processes; --env {ACCELERATE_CPU}=false turns it off")
