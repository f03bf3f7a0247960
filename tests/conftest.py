"""Shared fixtures: real data (scikit-learn's digits) written and converted at test time, and what
several files would otherwise each rebuild (640 px JPEG digits, a 2 x 2 CPU job, a fake clock),
made once a session. Tests marked `gpu` skip, saying why, where PyTorch sees no CUDA device."""

import json
import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from pipelines.demo import write_digits
from trainer.data.convert import convert
from trainer.model.arch import write_untrained_model

REPO = Path(__file__).resolve().parent.parent
SHARED_REFERENCE = REPO.parent / "shared" / "reference"


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip, saying why, where PyTorch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here "
                            "(CUDA build of torch, a GPU and its driver)")
    for item in items:
        if item.get_closest_marker("gpu"):  # not `in item.keywords`: that holds parameter ids too
            item.add_marker(skip)


def reference_file(*parts) -> Path:
    """A file of ../shared/reference (upstream CRDs, too large to keep in this repository). Skips
    the calling test, saying why, when that folder is not beside the repository (a clone on its
    own); CI has it, so the checks run there."""
    path = SHARED_REFERENCE.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"{path} is absent: the upstream reference files live in ../shared/reference "
                    "beside the repository (CI has them); a clone on its own skips this check")
    return path


# Keep tests from spreading over more threads than the 2 CI cores have.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def _converted(root: Path, limit=None) -> dict:
    write_digits(root / "raw", limit=limit)
    out = {}
    for split in ("train", "val"):
        convert(root / "raw" / split, root / split, progress=False)
        out[split] = root / split
    out["raw"] = root / "raw"
    return out


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> dict:
    """All 1,797 digits: {"train", "val", "raw"} paths (80/20 stratified split, seed 1)."""
    return _converted(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="session")
def tiny_digits(tmp_path_factory) -> dict:
    """30 digits per class (24 train / 6 val): for tests that only need something to run."""
    return _converted(tmp_path_factory.mktemp("tiny_digits"), limit=30)


@pytest.fixture(scope="session")
def micro_digits(tmp_path_factory) -> dict:
    """5 digits per class (4 train / 1 val): 3 steps an epoch at batch 16."""
    return _converted(tmp_path_factory.mktemp("micro"), limit=5)


@pytest.fixture(scope="session")
def digits_640(tiny_digits, tmp_path_factory) -> Path:
    """tiny_digits' validation digits as 640 px JPEGs (quality 90), converted: large enough that
    a 32 px model's resize decodes them at reduced (DCT-scaled) size."""
    root = tmp_path_factory.mktemp("digits_640")
    for f in sorted((tiny_digits["raw"] / "val").glob("*/*")):
        dest = root / "src" / f.parent.name / (f.stem + ".jpg")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(f) as im:
            im.convert("RGB").resize((640, 640), Image.Resampling.BICUBIC).save(dest, quality=90)
    convert(root / "src", root / "data", progress=False)
    return root / "data"


@pytest.fixture(scope="session")
def resnet18_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "resnet18"
    write_untrained_model(out, "resnet18")
    return out


def train_argv(model, data: dict, out, **options) -> list:
    """Flags for trainer.train.main / `kfvision train` (options as python names)."""
    argv = ["--model", str(model), "--train", str(data["train"]), "--val", str(data["val"]),
            "--out", str(out)]
    for k, v in options.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    return argv


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory, tiny_digits, resnet18_dir) -> Path:
    """A resnet18 trained for 2 epochs on tiny_digits (a real trained model directory, fast)."""
    from trainer.train import main

    out = tmp_path_factory.mktemp("trained") / "model"
    rc = main(train_argv(resnet18_dir, tiny_digits, out, epochs=2, image_size=32, batch_size=16,
                         lr=0.05, augment="none", print_freq=100))
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def trained_tiny_onnx(trained_tiny, tmp_path_factory) -> tuple:
    """trained_tiny exported to ONNX once a session (exporting is the slow part): (path, the
    metadata `export` wrote)."""
    from trainer.use.export import export

    path = tmp_path_factory.mktemp("onnx") / "model.onnx"
    return path, export(trained_tiny, "onnx", path)


def run_job(root: Path, data: dict, model, *, kind="pytorchjob", nodes=2, nproc=2) -> dict:
    """Render a `nodes` x `nproc` CPU job of `kind` (2 epochs of the digits at 32 px, batch 8)
    with `kfvision job render`, run it with `kfvision job run-local`.

    Returns {"rc": run-local's exit code, "out": the model directory, "metrics": its
    metrics.json, "logs": the log folder}.
    """
    from pipelines.cli import main

    name = f"digits-{kind}-{nodes}x{nproc}"
    out, manifest, logs = root / f"model-{name}", root / f"{name}.yaml", root / f"logs-{name}"
    kind_flags = ["--kind", "trainjob", "--runtime", "kfvision-torch"] if kind == "trainjob" \
        else []
    assert main(["job", "render", *kind_flags, "--name", name, "--image", "local",
                 "--nodes", str(nodes), "--procs-per-node", str(nproc), "--model", str(model),
                 "--train", str(data["train"]), "--val", str(data["val"]), "--out", str(out),
                 "--epochs", "2", "--image-size", "32", "--batch-size", "8", "--lr", "0.005",
                 "--augment", "none", "--print-freq", "100", "--workers", "0",
                 "-o", str(manifest)]) == 0
    rc = main(["job", "run-local", str(manifest), "--quiet", "--log-dir", str(logs)])
    return {"rc": rc, "out": out, "metrics": json.loads((out / "metrics.json").read_text()),
            "logs": logs}


@pytest.fixture(scope="session")
def pytorchjob_2x2(tmp_path_factory, tiny_digits, resnet18_dir) -> dict:
    """The 2 nodes x 2 processes PyTorchJob of `run_job` on tiny_digits, run once a session (what
    the 1 x 4 PyTorchJob and the 2 x 2 TrainJob are compared with)."""
    return run_job(tmp_path_factory.mktemp("pytorchjob_2x2"), tiny_digits, resnet18_dir)


class FakeClock:
    """A clock that moves only when slept on: `clock()` is the time, `clock.sleep(s)` moves it.
    Waits of any length take no real time (pass `sleep=clock.sleep, clock=clock`)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds
