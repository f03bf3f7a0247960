"""kfvision's modules never meet a user's (docs/scripts.md, "Whose modules a job imports"): a
script whose folder or requirements hold modules named like ours runs unchanged, its processes
import the user's modules, and kfvision's own processes in the job (the boot, the launcher)
import kfvision from its install, never through the script's folder, the working folder,
PYTHONPATH or the requirements' environment.

Every case runs as a 1 x 2 local job (`kfvision job run`, render + run-local, the commands a pod
runs) twice: on kfvision installed from its wheel, as the image has it (built once a run:
helpers/wheelinstall.py), and on `make setup`'s editable install; always from a folder outside
the repository, whose root would otherwise be the first place Python looks.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import REPO
from helpers.wheelinstall import site_packages, write_wheel

from kfvision.pipelines import contract

# Each process of the script says where each module it imports came from, which kfvision it
# sees, which python runs it, and how its parent (the launcher) was started.
PROBE = """\
import importlib, json, os, sys


def probe(*names):
    modules = {n: importlib.import_module(n).__file__ for n in names}
    ours = None
    if "kfvision" not in names:  # the user has no module of that name here
        import kfvision.trainer
        ours = kfvision.trainer.__file__
    with open(f"/proc/{os.getppid()}/cmdline") as f:
        parent = f.read().split("\\0")[:5]
    print("ISO " + json.dumps({"rank": os.environ["RANK"], "modules": modules, "kfvision": ours,
                               "python": sys.executable, "parent": parent}), flush=True)
"""
LAUNCHER = ["-I", "-u", "-m", "kfvision.trainer.launch"]
# in a requirements file: the test's `trainer` distribution, found as a third-party package is
# (by name, from a folder standing in for the index; a path outside --source is refused: a pod
# would not have it)
DIST = "{dist}"
DIST_REQUIREMENT = f"--no-index\n--find-links {DIST}\ntrainer==1.0\n"


def entry(*names) -> str:
    return f"{PROBE}\nprobe(*{names!r})\n"


# name: (the source folder, how the script is named, where each module must come from: "src" is
# the user's folder, "env" the requirements' environment)
CASES = {
    # with a kfvision.py of the user's, run from its folder, PYTHONPATH on another kfvision: the
    # user's processes then cannot import ours (the other cases check that they see our install)
    "trainer.py beside the entry, a pipelines/ package and a kfvision.py": (
        {"train.py": entry("trainer", "pipelines", "pipelines.steps", "kfvision"),
         "trainer.py": "WHOSE = 'user'\n", "pipelines/__init__.py": "", "pipelines/steps.py": "",
         "kfvision.py": "WHOSE = 'user'\n"},
        ["--entry", "train.py"],
        {"trainer": "src", "pipelines": "src", "pipelines.steps": "src", "kfvision": "src"}),
    "Vertex AI's trainer/task.py as --module trainer.task": (
        {"trainer/__init__.py": "", "trainer/task.py": entry("trainer")},
        ["--module", "trainer.task"], {"trainer": "src"}),
    "a requirement that installs a top-level trainer": (
        {"train.py": entry("trainer", "pipelines"), "requirements.txt": DIST_REQUIREMENT},
        ["--entry", "train.py"], {"trainer": "env", "pipelines": "env"}),
    "a script importing its own trainer beside that requirement": (
        {"train.py": entry("trainer"), "trainer.py": "", "requirements.txt": DIST_REQUIREMENT},
        ["--entry", "train.py"], {"trainer": "src"}),
}


@pytest.fixture(scope="session")
def trainer_dist(tmp_path_factory) -> Path:
    """A distribution named `trainer` with top-level `trainer` and `pipelines` packages, as a
    wheel in a folder that a requirements file names (--find-links). The package index has such
    a one (Coqui's training library), but installing it needs the network and brings torch's and
    a dozen other requirements: the names are what counts, and this one installs offline in a
    second."""
    return write_wheel(tmp_path_factory.mktemp("dist"), "trainer", {
        "trainer/__init__.py": "WHOSE = 'dist'\n", "pipelines/__init__.py": "WHOSE = 'dist'\n"})


@pytest.fixture(scope="session")
def env_cache(tmp_path_factory) -> Path:
    """One requirements cache for the file: the second case with the same requirements installs
    nothing."""
    return tmp_path_factory.mktemp("envs")


@pytest.fixture(params=["wheel", "editable"])
def install(request) -> tuple:
    """(python, kfvision.trainer's __init__.py, kfvision.pipelines' folder) of an install."""
    if request.param == "wheel":
        python = request.getfixturevalue("wheel_python")
        ours = site_packages(python) / "kfvision"
        return python, ours / "trainer" / "__init__.py", ours / "pipelines"
    # the paths this interpreter imports them from: the repository's folders, through the link
    # tree `make setup` writes for static tools (tools/linktree.py) when there is one
    import kfvision.pipelines
    import kfvision.trainer

    ours, pipelines = Path(kfvision.trainer.__file__), Path(kfvision.pipelines.__file__).parent
    assert (ours.resolve(), pipelines.resolve()) == (REPO / "trainer" / "__init__.py",
                                                     REPO / "pipelines")
    return Path(sys.executable), ours, pipelines


def write_tree(root: Path, files: dict, dist: Path) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text.replace(DIST, str(dist.parent)))
    return root


def run_job(python: Path, src: Path, target: list, out: Path, cwd: Path, env_cache: Path,
            flags=()) -> str:
    """`kfvision job run` of `src` as 1 x 2, with `python`'s install, from `cwd`: its output."""
    argv = [str(python.parent / "kfvision"), "job", "run", "--name", "iso", "--image", "img",
            "--nproc-per-node", "2", "--source", str(src), *target, *flags,
            "-o", str(out / "job.yaml"), "--log-dir", str(out / "logs")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({contract.ENV_CACHE: str(env_cache), "PIP_NO_INDEX": "1"})  # offline
    run = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout + run.stderr


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_the_users_modules_are_the_users_and_kfvisions_are_its_installs(
        case, install, tmp_path, trainer_dist, env_cache):
    files, target, origins = CASES[case]
    python, ours, pipelines = install
    src = write_tree(tmp_path / "proj", files, trainer_dist)
    cwd, flags = tmp_path, []
    if "kfvision" in origins:  # the job's working folder and PYTHONPATH hold a kfvision too
        shadow = write_tree(tmp_path / "shadow", {
            "kfvision/__init__.py": "raise ImportError('the kfvision on PYTHONPATH')\n"},
            trainer_dist)
        cwd, flags = src, ["--env", f"PYTHONPATH={shadow}"]
    log = run_job(python, src, target, tmp_path / "out", cwd, env_cache, flags)

    assert f"kfvision's modules from {pipelines} on {python} (isolated)" in log
    reports = [json.loads(line.split("ISO ", 1)[1]) for line in log.splitlines()
               if "ISO {" in line]
    assert sorted(r["rank"] for r in reports) == ["0", "1"], log
    env_python = "requirements.txt" in files
    for r in reports:
        assert r["parent"] == [str(python), *LAUNCHER]  # the launcher: our install, isolated
        assert r["python"].startswith(str(env_cache)) if env_python else \
            r["python"] == str(python)
        for name, origin in origins.items():
            where = r["modules"][name]
            if origin == "src":  # the snapshot unpacked in the pod's scratch folder
                assert "/kfvision/work/src/" in where, (name, where)
            else:
                assert where.startswith(str(env_cache)) and "site-packages" in where, (
                    name, where)
        if r["kfvision"] is not None:  # the user's processes see the same kfvision
            assert r["kfvision"] == str(ours)
    assert "Setting OMP_NUM_THREADS" not in log


@pytest.mark.slow
def test_the_wheel_holds_every_module_of_the_repository_under_one_name(wheel_python):
    """A folder without `__init__.py` is left out of the wheel by setup.py's find_packages, and
    the editable install would never show it. Its one top-level name is kfvision's own, so no
    other distribution's `trainer` or `pipelines` shares a folder of site-packages with it."""
    import zipfile

    (wheel,) = (wheel_python.parents[2] / "dist").glob("kfvision-*.whl")
    version = wheel.name.split("-")[1]
    with zipfile.ZipFile(wheel) as z:
        assert {n.split("/")[0] for n in z.namelist()} == {"kfvision",
                                                           f"kfvision-{version}.dist-info"}
    ours = site_packages(wheel_python) / "kfvision"
    for folder in ("trainer", "pipelines"):
        want = {p.relative_to(REPO) for p in (REPO / folder).rglob("*.py")}
        got = {p.relative_to(ours) for p in (ours / folder).rglob("*.py")}
        assert want == got, sorted(map(str, want ^ got))
