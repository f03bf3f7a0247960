"""bench/gpu.sh: its summary table, and a smoke run where kfvision is not installed, as on a lent
GPU machine (torch and torchvision there, no network): bench/importroot.sh then imports it from
the checkout."""

import os
import shutil
import subprocess
import sys
import venv

import pytest
from helpers.paths import REPO

from bench.gpu import PRESETS, summary


def test_the_summary_sets_each_run_against_the_steps_ceiling():
    step = {"best": {"variant": "graphs", "images_per_sec": 8000.0}}
    runs = {"plain": {"8": {"images_per_sec": 1000.0, "seconds": 44.0, "epoch1_seconds": 5.0}},
            "default": {"images_per_sec": 4000.0, "seconds": 30.0, "epoch1_seconds": 9.5},
            "gpu-pipeline": {"images_per_sec": 7200.0, "seconds": 25.0, "epoch1_seconds": 4.0}}
    table = summary(step, {"resnet50": runs}, PRESETS["quick"], "cuda").splitlines()
    assert table[2] == "| step only, no input pipeline (best: graphs) | 8000 | 100% | | |"
    assert table[3] == "| plain loop, ImageFolder + PIL, 8 workers | 1000 | 12% | 44.0 | 5.0 |"
    assert table[4].endswith("| 4000 | 50% | 30.0 | 9.5 |")
    assert table[5].startswith("| kfvision `--cache off`") and "| 7200 | 90% |" in table[5]


def _python_without_kfvision(root):
    """A Python that has this one's packages (torch, torchvision, ...) but not kfvision: a venv
    whose .pth lists the site directories as plain paths, so the editable install's finder (a
    .pth of those directories) is never run."""
    venv.create(root, with_pip=False, symlinks=True)
    python = root / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path("
                              "'purelib'))"], capture_output=True, text=True, check=True)
    sites = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    (root / purelib.stdout.strip() / "_here.pth").write_text("\n".join(sites) + "\n")
    return python


# what bench/gpu.sh and bench/device_run.sh do first; then the module runs, and the trainer in
# a process of its own, as bench.train starts it
_IMPORT_ROOT = """
source bench/importroot.sh
"$PYTHON" -c 'import kfvision.trainer.train as t, kfvision.pipelines as p; print(t.__file__)'
"$PYTHON" -m kfvision.trainer.train --help | head -n 1
"""


@pytest.mark.slow  # 7-8 s of CPU in the processes it starts
def test_the_import_root_serves_a_checkout_without_an_install(tmp_path):
    """As on a lent GPU machine: torch there, kfvision not installed. A copy of the folders the
    benchmark needs, and a Python without kfvision; bench/importroot.sh makes the copy's
    trainer/ and pipelines/ importable as kfvision.*, for it and the processes it starts.
    (`bash bench/gpu.sh --device cpu --smoke` runs the whole benchmark so: `make bench-smoke`.)"""
    tree = tmp_path / "tree"
    for folder in ("bench", "trainer", "pipelines"):
        shutil.copytree(REPO / folder, tree / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "build"))
    python = _python_without_kfvision(tmp_path / "venv")
    check = subprocess.run([python, "-c", "import kfvision.trainer"], capture_output=True)
    assert check.returncode != 0  # the situation under test: no kfvision to import
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(["bash", "-c", _IMPORT_ROOT], cwd=tree, capture_output=True, text=True,
                         env={**env, "PYTHON": str(python)}, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"importing it from {tree}/build/importroot" in run.stderr
    module, usage = run.stdout.splitlines()
    assert module == f"{tree}/build/importroot/kfvision/trainer/train.py"
    assert usage.startswith("usage: ")
    # where kfvision is this checkout's install, nothing is linked
    again = subprocess.run(["bash", "-c", "source bench/importroot.sh"], cwd=REPO,
                           capture_output=True, text=True,
                           env={**env, "PYTHON": sys.executable}, timeout=60)
    assert again.returncode == 0 and "importing it from" not in again.stderr, again.stderr
