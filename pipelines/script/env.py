"""A script's `requirements.txt`, installed once into a virtual environment that keeps the
image's torch and torchvision.

    python = ensure_env(Path("src/requirements.txt"), cache_root)   # -> .../bin/python

The environment is `python -m venv --without-pip --system-site-packages` of the running
interpreter, plus a `.pth` file that adds the running interpreter's own site folders (so a
kfvision installed in another virtual environment, as on a laptop, is seen too: a venv made from
a venv would otherwise see only the base Python's packages). The environment's own
site-packages come first, so what the requirements install wins, except torch and torchvision:
they are pinned to the running versions by a constraints file, so a stray `torch` line is
satisfied by the image's and cannot replace it. pip is the running interpreter's, pointed at the
environment with `--python`.

It lives at `cache_root/<key>`, key = sha256 of the requirements, the interpreter and the pinned
versions; a finished one holds a `.complete` marker, so a second run with the same requirements
installs nothing. A file lock keeps two pods of one machine (run-local) from building it twice.
"""

import contextlib
import fcntl
import hashlib
import shutil
import site
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

from kfvision.trainer.errors import KfvisionError

PINNED = ("torch", "torchvision")  # never replaced by a requirements file
DONE = ".complete"


class RequirementsInstallError(KfvisionError):
    """pip could not install the script's requirements (exit code 2: the same requirements fail
    the same way on a retry)."""


def pins() -> list:
    """`name==version` of the running interpreter's torch and torchvision (those it has)."""
    out = []
    for name in PINNED:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out.append(f"{name}=={metadata.version(name)}")
    return out


def env_key(requirements: bytes) -> str:
    h = hashlib.sha256(requirements)
    for part in (sys.executable, sys.version, *pins()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:32]


def _python(path: Path) -> Path:
    return path / "bin" / "python"


def _site_packages(path: Path) -> Path:
    v = sys.version_info
    return path / "lib" / f"python{v.major}.{v.minor}" / "site-packages"


def _build(path: Path, requirements: Path) -> None:
    if path.exists():
        shutil.rmtree(path)  # a build that was killed half-way
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(path)
    parents = [p for p in (*site.getsitepackages(), *sys.path)
               if p.endswith("site-packages") and Path(p).is_dir()]
    lines = [f"import site; site.addsitedir({p!r})" for p in dict.fromkeys(parents)]
    (_site_packages(path) / "_kfvision_parent.pth").write_text("\n".join(lines) + "\n")
    constraints = path / "constraints.txt"
    constraints.write_text("".join(p + "\n" for p in pins()))
    argv = [sys.executable, "-m", "pip", "--python", str(_python(path)), "install",
            "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
            "-c", str(constraints), "-r", str(requirements)]
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        shutil.rmtree(path, ignore_errors=True)
        tail = proc.stdout.decode("utf-8", errors="replace").strip().splitlines()[-8:]
        lines = "\n".join(f"    {line}" for line in tail)
        raise RequirementsInstallError(
            f"pip could not install {requirements.name} (exit code {proc.returncode}); fix "
            f"the requirement, or drop it. pip's last lines:\n{lines}")
    (path / DONE).write_text(" ".join(argv[1:]) + "\n")


def ensure_env(requirements: Path, cache_root: Path, say=print) -> Path:
    """The python of the environment for `requirements` (built once; see the module docstring).

    Raises:
        RequirementsInstallError: pip failed (its last lines are in the message).
    """
    requirements = Path(requirements)
    try:
        data = requirements.read_bytes()
    except OSError as e:
        raise RequirementsInstallError(f"cannot read the requirements {requirements}: {e}") from e
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    path = cache_root / env_key(data)
    if (path / DONE).is_file():
        say(f"requirements: {requirements.name} already installed in {path} (cached)")
        return _python(path)
    with (cache_root / f"{path.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another pod of this machine may be building it
        if not (path / DONE).is_file():
            say(f"requirements: installing {requirements.name} into {path} "
                f"(pinned: {', '.join(pins()) or 'nothing'})")
            _build(path, requirements)
    return _python(path)
