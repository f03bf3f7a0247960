"""Azure ML v1's `Run` and Horovod's `horovod.torch` for scripts that import them: kfvision's
stand-ins (pipelines/script/azurerun.py, hvd.py, hvdopt.py; their import names in shims/) reach
the script's processes only when the script imports the package and its environment has none of
its own, and only theirs: the folder goes last on their PYTHONPATH, after the user's entries, so
the script's folder and anything the user put first still win. kfvision's own processes run
isolated (`python -I`: no PYTHONPATH) and never see it.

    path, lines = plan(src, python, env)   # the folders to add, the boot's lines about them
"""

import os
import re
import site
import sys
from pathlib import Path

SHIMS = Path(__file__).parent / "shims"
# top-level name -> (our folder under SHIMS, the module whose presence means "theirs", the
# distribution to name, what ours does, what theirs does here)
BRIDGES = {
    "azureml": ("azure", "azureml/core", "azureml-core",
                "kfvision's Run stands in: run.log reaches `job status` and MLflow",
                "its run.log reaches nothing outside Azure (an offline run); drop it from the "
                "requirements for kfvision's Run (job status, MLflow, register_model)"),
    "horovod": ("horovod", "horovod/torch", "horovod",
                "kfvision's horovod.torch on torch.distributed stands in",
                "it runs as the script's own (it needs its MPI or Gloo build)"),
}
_IMPORT = re.compile(r"^\s*(?:from|import)\s+(azureml|horovod)\b", re.MULTILINE)
_MAX_BYTES = 2_000_000  # a bigger .py is data, not the script's code


def imported(src: Path) -> set:
    """The bridged names (BRIDGES) the .py files under `src` import."""
    found = set()
    for path in Path(src).rglob("*.py"):
        try:
            if path.stat().st_size <= _MAX_BYTES:
                found |= set(_IMPORT.findall(path.read_text(encoding="utf-8", errors="replace")))
        except OSError:
            continue
    return found


def search_path(python: Path, env: dict, src: Path) -> list:
    """Where the script's python looks for packages: the source folder, PYTHONPATH, the
    requirements' environment (when `python` is one) and this interpreter's site folders (which
    that environment sees too: pipelines/script/env.py)."""
    paths = [str(src), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    root = Path(python).parent.parent
    v = sys.version_info
    paths.append(str(root / "lib" / f"python{v.major}.{v.minor}" / "site-packages"))
    paths += [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    return [p for p in dict.fromkeys(paths) if p]


def has_own(module: str, paths: list) -> bool:
    """Whether `module` (a/b) is a package or module in one of `paths`."""
    return any((Path(p) / module / "__init__.py").is_file() or
               (Path(p) / f"{module}.py").is_file() for p in paths)


def plan(src: Path, python: Path, env: dict) -> tuple:
    """(folders to append to the script's PYTHONPATH, one line per bridged package the script
    imports)."""
    wanted = imported(src)
    paths = search_path(python, env, src) if wanted else []
    add, lines = [], []
    for name in sorted(wanted):
        folder, module, dist, ours, theirs = BRIDGES[name]
        if has_own(module, paths):
            lines.append(f"{name}: the script's environment has {dist} of its own: {theirs}")
        else:
            add.append(str(SHIMS / folder))
            lines.append(f"{name}: no {dist} in the script's environment: {ours} "
                         "(docs/scripts.md)")
    return add, lines


def apply(env: dict, add: list) -> None:
    """Append the `add` folders to `env`'s PYTHONPATH (after the user's entries)."""
    if add:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), *add]))
