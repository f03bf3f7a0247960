"""kfvision as the image installs it: built into a wheel, installed into a fresh virtual
environment, run from a folder outside the repository. The editable install (`make setup`'s)
maps kfvision.* onto the repository's folders, and the repository's root is on the tests'
sys.path: neither shows what a wheel install does (a module the wheel lacks, a name it shadows).

    python = wheel_install(folder)   # folder/venv/bin/python, kfvision from folder/dist/*.whl

The new environment reuses this one's packages (torch and the rest: installing them again takes
minutes and gigabytes) through a `.pth` file naming this environment's site-packages. A path
line does not run that folder's own `.pth` files (the site module's addsitedir runs those of the
folders it is given, not of the paths they add), so the editable install's finder stays out, and
kfvision is the wheel's alone.
"""

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from helpers.paths import REPO

# What setup.py and pyproject.toml build the wheel from (a copy: building in the repository would
# leave build/ and *.egg-info there, under the feet of a parallel run)
SOURCES = ("setup.py", "pyproject.toml", "README.md", "trainer", "pipelines")


def _run(argv: list) -> None:
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{' '.join(map(str, argv))}:\n{run.stdout}\n{run.stderr}"


def build_wheel(folder: Path) -> Path:
    """kfvision's wheel, built once from a copy of the sources into folder/dist."""
    src = folder / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--disable-pip-version-check", "--no-input", "-q", "-w", str(folder / "dist"), str(src)])
    (wheel,) = (folder / "dist").glob("kfvision-*.whl")
    return wheel


def wheel_install(folder: Path) -> Path:
    """A fresh environment under `folder` with kfvision from its wheel (module docstring): its
    python."""
    wheel = build_wheel(folder)
    venv.EnvBuilder(with_pip=False, symlinks=True).create(folder / "venv")
    python = folder / "venv" / "bin" / "python"
    own = site_packages(python)
    (own / "test-environment.pth").write_text("".join(f"{p}\n" for p in _site_folders()))
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--disable-pip-version-check", "--no-input", "-q", str(wheel)])
    where = subprocess.run([str(python), "-I", "-c", "import kfvision.trainer as t; "
                            "print(t.__file__)"], capture_output=True, text=True).stdout
    assert where.startswith(str(own)), f"kfvision from {where!r}, not the wheel's {own}"
    return python


def _site_folders() -> list:
    """This environment's site-packages, and those its `.pth` files add (a thin environment
    that reuses another's packages: the worktrees of one machine)."""
    found = [sysconfig.get_paths()["purelib"], *(p for p in sys.path
                                                 if p.endswith("site-packages"))]
    return [p for p in dict.fromkeys(found) if Path(p).is_dir()]


def site_packages(python: Path) -> Path:
    """The site-packages folder of the environment of `python`."""
    return Path(subprocess.run([str(python), "-I", "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())


def write_wheel(folder: Path, name: str, files: dict, version: str = "1.0") -> Path:
    """A pure-Python wheel of distribution `name` holding `files` ({path: text}), written by hand
    (PEP 427: the files, then METADATA, WHEEL and RECORD under NAME-VERSION.dist-info): pip
    installs it from its path with no index and no build."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {**files,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: kfvision-tests\n"
                              "Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    path = folder / f"{name}-{version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for rel, text in files.items():
            data = text.encode()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{rel},sha256={digest.decode()},{len(data)}")
            z.writestr(rel, data)
        z.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path
