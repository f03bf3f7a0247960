"""A script's requirements, installed into virtual environments that keep the image's torch and
torchvision: the third-party packages once, into a cache; the script's own packages (the lines
that point into its snapshot: `-e .`, `.`, `./libs/x`) per job, on top.

    reqs = requirements.read(src / "requirements.txt", src)      # pipelines/script/requirements.py
    python = ensure_env(reqs, cache_root, "requirements.txt")    # -> .../bin/python (cached)
    python = local_layer(reqs, python, work / "local-env", src, "requirements.txt")  # if local

Each environment is `python -m venv --without-pip --system-site-packages` of the running
interpreter, plus a `.pth` file that adds the folders below it (the cached environment, for the
per-job layer) and the running interpreter's own site folders (so a kfvision installed in another
virtual environment, as on a laptop, is seen too: a venv made from a venv would otherwise see
only the base Python's packages). An environment's own site-packages come first, so what the
requirements install wins, except torch and torchvision: they are pinned to the running versions
by a constraints file, so a stray `torch` line is satisfied by the image's and cannot replace it.
pip is the running interpreter's, pointed at the environment with `--python`; it sees what the
folders below hold as installed, so the layer installs only what the cache lacks.

The cache lives at `cache_root/<key>`, key = sha256 of the third-party lines, the constraints,
the interpreter and the pinned versions; a finished one holds a `.complete` marker, so a second
run with the same requirements installs nothing. A file lock keeps two pods of one machine
(run-local) from building it twice. The local lines are not in the key and never enter the cache:
a key made of the requirements' text alone (`-e .` never changes) gave one project another's
code, and an edited project its old code (docs/scripts.md "Packaged projects" says why a layer
per job rather than a key over the packages' content).
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


def env_key(reqs) -> str:
    """The cache key of `reqs`' third-party lines (a Requirements: pipelines/script/
    requirements.py), the interpreter and the pins: the local lines are not in it (they are
    installed per job, `local_layer`)."""
    h = hashlib.sha256("\n".join(reqs.third_party).encode())
    for part in (*reqs.constraints, sys.executable, sys.version, *pins()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:32]


def _python(path: Path) -> Path:
    return path / "bin" / "python"


def _site_packages(path: Path) -> Path:
    v = sys.version_info
    return path / "lib" / f"python{v.major}.{v.minor}" / "site-packages"


def _layered_venv(path: Path, below: list) -> list:
    """A venv at `path` (no pip) that sees, after its own site-packages, the folders `below`
    and the running interpreter's site folders, in that order; those folders."""
    if path.exists():
        shutil.rmtree(path)  # a build that was killed half-way, or the last job's layer
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(path)
    parents = [p for p in (*site.getsitepackages(), *sys.path)
               if p.endswith("site-packages") and Path(p).is_dir()]
    lines = [f"import site; site.addsitedir({p!r})" for p in dict.fromkeys([*below, *parents])]
    (_site_packages(path) / "_kfvision_parent.pth").write_text("\n".join(lines) + "\n")
    return list(dict.fromkeys([*below, *parents]))


def _pip(path: Path, lines, constraints, cwd: Path, what: str, extra=()) -> list:
    """pip installs `lines` into the venv `path`, the pins and `constraints` as constraints;
    its argv."""
    (path / "constraints.txt").write_text("".join(c + "\n" for c in (*pins(), *constraints)))
    (path / "requirements.txt").write_text("".join(f"{line}\n" for line in lines))
    argv = [sys.executable, "-m", "pip", "--python", str(_python(path)), "install",
            "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
            *extra, "-c", str(path / "constraints.txt"), "-r", str(path / "requirements.txt")]
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, cwd=cwd)
    if proc.returncode != 0:
        shutil.rmtree(path, ignore_errors=True)
        tail = proc.stdout.decode("utf-8", errors="replace").strip().splitlines()[-8:]
        lines = "\n".join(f"    {line}" for line in tail)
        raise RequirementsInstallError(
            f"pip could not install {what} (exit code {proc.returncode}); fix the "
            f"requirement, or drop it. pip's last lines:\n{lines}")
    return argv


def _build(path: Path, reqs, what: str) -> None:
    _layered_venv(path, [])
    argv = _pip(path, reqs.third_party, reqs.constraints, path, what)
    (path / DONE).write_text(" ".join(argv[1:]) + "\n")


def local_layer(reqs, base: Path | None, path: Path, cwd: Path, what: str, say=print) -> Path:
    """The python of a fresh environment at `path` (this job's) holding `reqs`' local lines,
    on top of the cached environment `base` (a python; None: this interpreter): the script's
    own packages come from its snapshot, every job anew, and never enter the shared cache.

    Raises:
        RequirementsInstallError: pip failed.
    """
    below = [str(_site_packages(base.parent.parent))] if base is not None else []
    sites = _layered_venv(path, below)
    said = ", ".join(f"{x.written} -> {x.path}" for x in reqs.local)
    here = backends_here([x.path for x in reqs.local], sites)
    say(f"requirements: {what}: {len(reqs.local)} from the snapshot, installed for this job "
        f"into {path}: {said}" + (" (built with the build backend already installed)" if here
                                  else ""))
    lines = [x.line for x in reqs.local]
    try:
        _pip(path, lines, reqs.constraints, cwd, what, ["--no-build-isolation"] if here else [])
    except RequirementsInstallError:
        if not here:
            raise
        say("requirements: that build failed; again in pip's own isolated build environment")
        _layered_venv(path, below)
        _pip(path, lines, reqs.constraints, cwd, what)
    return _python(path)


def backends_here(projects, sites: list) -> bool:
    """Whether every local project (a folder) can be built with what `sites` hold: each of its
    `[build-system] requires` (pyproject.toml; setuptools without one, as pip assumes) installed
    there in a version that meets it. Then pip builds with those (`--no-build-isolation`)
    rather than installing them into a build environment of its own for every project and job,
    about half of a layer's time (docs/benchmarks.md)."""
    from importlib import metadata

    from kfvision.pipelines.script.entry import toml_module
    from packaging.requirements import InvalidRequirement, Requirement

    tomllib = toml_module()
    if tomllib is None:
        return False  # Python 3.10 without tomli: pip's default
    for project in projects:
        if not Path(project).is_dir():
            return False  # an archive or a wheel: pip's default
        try:
            data = tomllib.loads((Path(project) / "pyproject.toml").read_text(encoding="utf-8"))
        except FileNotFoundError:
            data = {}
        except (OSError, ValueError):
            return False
        system = data.get("build-system")
        requires = system.get("requires") if isinstance(system, dict) else ["setuptools>=40.8.0"]
        for text in requires if isinstance(requires, list) else [None]:
            try:
                req = Requirement(text)
            except (InvalidRequirement, TypeError):
                return False
            if req.marker is not None and not req.marker.evaluate():
                continue
            dist = next(iter(metadata.distributions(name=req.name, path=sites)), None)
            if dist is None or not req.specifier.contains(dist.version, prereleases=True):
                return False
    return True


def ensure_env(reqs, cache_root: Path, what: str, say=print) -> Path:
    """The python of the cached environment of `reqs`' third-party lines (a Requirements;
    built once, see the module docstring); `what`: the file's name in what it says.

    Raises:
        RequirementsInstallError: pip failed (its last lines are in the message).
    """
    from kfvision.pipelines.script.snapshot import tag_made

    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    tag_made(cache_root)  # never packed, if it lies in a source folder
    path = cache_root / env_key(reqs)
    if (path / DONE).is_file():
        say(f"requirements: {what} already installed in {path} (cached)")
        return _python(path)
    with (cache_root / f"{path.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another pod of this machine may be building it
        if not (path / DONE).is_file():
            say(f"requirements: installing {what} into {path} "
                f"(pinned: {', '.join(pins()) or 'nothing'})")
            _build(path, reqs, what)
    return _python(path)
