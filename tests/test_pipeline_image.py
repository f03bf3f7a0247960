"""The trainer image as far as it can be checked without a container engine: the Dockerfiles say
what they must, and the commands the PyTorchJob and the KFP steps call exist in this install."""

import ast
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.paths import REPO

from kfvision.pipelines.flow import components
from kfvision.pipelines.jobs.config import TRAIN_COMMAND, JobConfig
from kfvision.trainer.config import TrainConfig

DOCKERFILES = [REPO / "images" / "Dockerfile", REPO / "images" / "Dockerfile.cpu"]


def instructions(path: Path) -> list:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", "\n".join(
        line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_pins_its_base_and_runs_as_the_jobs_non_root_user(dockerfile):
    steps = instructions(dockerfile)
    args = dict(a[1].split("=", 1) for a in steps if a[0] == "ARG")
    base = args["BASE_IMAGE"]
    # A patch-level tag of the Python CI tests on: never `latest`, never a bare minor.
    match = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-slim-\w+", base)
    assert match, base
    assert tuple(map(int, match.groups()[:2])) == sys.version_info[:2]
    assert ("FROM", "${BASE_IMAGE}") in steps
    users = [a[1] for a in steps if a[0] == "USER"]
    run_as = JobConfig(name="x", image="y", train=TrainConfig("m", "t", "v", "o")).run_as_user
    assert users == [f"{run_as}:{run_as}"]  # what the rendered PyTorchJob's pods run as
    runs = " ".join(a[1] for a in steps if a[0] == "RUN")
    assert "pip install -c constraints.txt \".${EXTRAS}\"" in runs  # CI's exact versions (+ extras)
    for path in ("/gcs", "/minio", "/s3"):  # where KFP's launcher writes artifacts
        assert path in runs
    assert f"chown {run_as}:{run_as}" in runs


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_everything_the_package_build_needs(dockerfile):
    import tomllib

    copied = {src.rstrip("/") for a in instructions(dockerfile) if a[0] == "COPY"
              for src in a[1].split()[:-1]}  # COPY SRC... DEST
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = {"pyproject.toml", "setup.py", "constraints.txt", project["project"]["readme"]}
    setup = ast.parse((REPO / "setup.py").read_text())
    needed |= next(set(ast.literal_eval(node.value)) for node in setup.body
                   if isinstance(node, ast.Assign) and node.targets[0].id == "FOLDERS")
    assert needed <= copied, needed - copied


@pytest.mark.slow
def test_the_pytorchjobs_command_exists_here():
    exe = shutil.which(TRAIN_COMMAND[0], path=str(Path(sys.executable).parent))
    assert exe, f"{TRAIN_COMMAND[0]} is not installed next to {sys.executable}"
    run = subprocess.run([sys.executable, "-m", *TRAIN_COMMAND[2:], "--help"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--epochs" in run.stdout


def test_every_component_runs_with_kfp_and_kfvision_as_installed():
    assert importlib.util.find_spec("kfp.dsl.executor_main") is not None
    comps = [getattr(components, n) for n in dir(components)
             if hasattr(getattr(components, n), "component_spec")]
    # every component the compiled pipeline runs is here (a new step is checked, not counted)
    spec = next(yaml.safe_load_all((REPO / "tests" / "golden" /
                                    "pipeline-image-classification.yaml").read_text()))
    used = {re.sub(r"-\d+$", "", k.removeprefix("exec-"))
            for k in spec["deploymentSpec"]["executors"]}
    assert {c.component_spec.name for c in comps} == used
    for comp in comps:
        source = comp.python_func.__code__.co_filename
        tree = ast.parse(Path(source).read_text())
        func = next(n for n in ast.walk(tree)
                    if isinstance(n, ast.FunctionDef) and n.name == comp.python_func.__name__)
        for node in ast.walk(func):  # what the body imports when KFP runs it in the image
            if isinstance(node, ast.ImportFrom) and node.module.startswith("pipelines"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module}.{alias.name}"
        container = comp.component_spec.implementation.container
        assert container.image == components.DEFAULT_IMAGE
        assert "pip install" not in " ".join(container.command)
