"""bench/gpu.sh: its summary table, and a smoke run where kfvision is not installed, as on a lent
GPU machine (torch and torchvision there, no network): bench/importroot.sh then imports it from
the checkout."""

import json
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


@pytest.mark.slow
def test_gpu_sh_runs_from_a_checkout_without_an_install(tmp_path):
    tree = tmp_path / "tree"
    for folder in ("bench", "trainer", "pipelines"):
        shutil.copytree(REPO / folder, tree / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "build"))
    python = _python_without_kfvision(tmp_path / "venv")
    check = subprocess.run([python, "-c", "import kfvision.trainer"], capture_output=True)
    assert check.returncode != 0  # the situation under test: no kfvision to import
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(["bash", "bench/gpu.sh", "--device", "cpu", "--smoke", "--epochs", "1",
                          "--step-variants", "channels-last", "--variants", "gpu-pipeline"],
                         cwd=tree, env={**env, "PYTHON": str(python)}, capture_output=True,
                         text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"importing it from {tree}/build/importroot" in run.stderr
    bench = tree / "build" / "bench"
    rows = [r for r in (bench / "gpu-cpu.md").read_text().splitlines() if r.startswith("| ")]
    assert [r.split("|")[1].strip()[:14] for r in rows[1:]] == [
        "step only, no ", "plain loop, Im", "kfvision `--ca"], rows
    metrics = json.loads((bench / "trained" / "resnet18-gpu-pipeline" / "metrics.json")
                         .read_text())
    assert metrics["fast_path"]["gpu_decode"] is True  # the batched path, from the copy
