"""The CUDA paths, on a machine with a GPU: DDP over NCCL, `--gpu-decode` with nvJPEG, bf16
autocast on CUDA, `kfvision serve --device cuda`, and the GPU benchmark (bench/gpu.sh) in small.

Every test here is marked `gpu`; conftest.py skips them, saying why, where PyTorch sees no CUDA
device. The CPU tests run the same code with gloo, libjpeg and fp32 (test_distributed.py,
test_devicedata.py, test_fastpath.py, test_serve.py); these check what only a GPU runs. cuDNN
picks its algorithms by its heuristics and convolutions use TF32, so two GPU runs, or a GPU and
a CPU run, agree within a tolerance, not bit for bit.
"""

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml
from helpers.paths import REPO
from helpers.runs import DIGITS_RUN, train_argv
from PIL import Image

from kfvision.pipelines.serve.client import Server, request, v2_body
from kfvision.trainer.data.convert import convert
from kfvision.trainer.data.devicedata import EncodedImages, make_device_loader
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.train import main
from kfvision.trainer.use.predict import Predictor
from kfvision.trainer.use.score import score

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# the digits in 3 epochs at 32 px (helpers.runs.DIGITS_RUN: > 0.9 top-1 on the CPU), seed 3
DIGITS = {**DIGITS_RUN, "seed": 3}


def _cli(*args, env=None, timeout=500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kfvision.pipelines.cli", *map(str, args)],
                          cwd=REPO,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def _metrics(out) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _fast_path(out) -> dict:
    """The fast-path settings the run resolved (config.yaml: `fast_path`)."""
    return yaml.safe_load((out / "config.yaml").read_text())["fast_path"]


def _assert_learned(m: dict) -> None:
    """A completed run whose losses are finite and whose training loss went down."""
    losses = [h[k] for h in m["history"] for k in ("train_loss", "val_loss")]
    assert m["status"] == "completed" and all(math.isfinite(x) for x in losses), m
    assert m["history"][-1]["train_loss"] < m["history"][0]["train_loss"], m["history"]


# --- DDP over NCCL -------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.skipif(0 < GPUS < 2, reason=f"DDP over NCCL needs 2 GPUs, this machine has {GPUS}: "
                    "NCCL refuses two ranks on one GPU, and a world of 1 starts no process group")
def test_two_processes_over_nccl_keep_identical_weights_and_learn_the_digits(
        tmp_path, resnet18_dir, digits):
    out = tmp_path / "model"
    run = _cli("train", "--nproc-per-node", "2",
               *train_argv(resnet18_dir, digits, out, device="cuda", **{**DIGITS, "epochs": 4}),
               env={"NCCL_DEBUG": "INFO"})  # NCCL says it set up its communicator
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-5000:]
    assert "NCCL INFO" in text  # the process group is NCCL's, not gloo's
    assert "2 process(es) on cuda" in text and "weights identical on all 2 rank(s)" in text
    m = _metrics(out)
    assert m["world_size"] == 2
    _assert_learned(m)
    assert m["final"]["val_top1"] > 0.8, m["final"]


@pytest.mark.distributed
def test_more_processes_per_node_than_gpus_are_refused_before_training(tmp_path, resnet18_dir,
                                                                       tiny_digits):
    nproc = GPUS + 1
    out = tmp_path / "model"
    run = _cli("train", "--nproc-per-node", nproc,
               *train_argv(resnet18_dir, tiny_digits, out, device="cuda", epochs=1, image_size=32),
               timeout=300)
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert (f"{nproc} processes per node were started but this node has {GPUS} GPU(s)"
            in run.stdout + run.stderr)
    assert not (out / "weights.pt").exists()


# --- --gpu-decode: nvJPEG ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jpeg_digits(digits, tmp_path_factory) -> dict:
    """All the digits as 96 px colour JPEGs (quality 90): {"train", "val"}, converted."""
    root = tmp_path_factory.mktemp("jpeg_digits")
    for part in ("train", "val"):
        for f in sorted((digits["raw"] / part).glob("*/*")):
            dest = root / "src" / part / f.parent.name / (f.stem + ".jpg")
            dest.parent.mkdir(parents=True, exist_ok=True)
            with Image.open(f) as im:
                im.convert("RGB").resize((96, 96), Image.Resampling.BICUBIC).save(dest,
                                                                                  quality=90)
        convert(root / "src" / part, root / part, progress=False)
    return {"train": root / "train", "val": root / "val"}


def _batches(imdir, device) -> tuple[list, int]:
    loader, _ = make_device_loader(EncodedImages(imdir), augment="none", image_size=32,
                                   device=device, batch_size=16, workers=0, shuffle=False, seed=1)
    batches = list(loader)
    return batches, loader.cpu_fallbacks


@pytest.mark.parametrize("data", ["digits_640", "jpeg_digits"])
def test_nvjpeg_batches_are_libjpegs_within_rounding(data, request):
    fixture = request.getfixturevalue(data)
    imdir = read_image_directory(fixture if data == "digits_640" else fixture["val"])
    (gpu, fallbacks), (cpu, _) = _batches(imdir, "cuda"), _batches(imdir, "cpu")
    assert fallbacks == 0  # nvJPEG decoded every image itself
    assert len(gpu) == len(cpu) == math.ceil(len(imdir.images) / 16)
    for (g, g_labels), (c, c_labels) in zip(gpu, cpu):
        assert g.device.type == "cuda" and g.dtype == torch.uint8 and g.shape == c.shape
        assert torch.equal(g_labels, c_labels)
        diff = (g.cpu().int() - c.int()).abs()
        # two JPEG decoders (IDCT, chroma upsampling) and two resizes: a level or so apart
        assert diff.float().mean() < 1.5 and diff.max() <= 32, (diff.float().mean(), diff.max())


def test_training_with_gpu_decode_learns_as_the_cpu_decode_does(tmp_path, resnet18_dir,
                                                                jpeg_digits):
    finals = {}
    for setting in ("on", "off"):
        out = tmp_path / setting
        assert main(train_argv(resnet18_dir, jpeg_digits, out, device="cuda", gpu_decode=setting,
                               amp="off", workers=2, **DIGITS)) == 0
        assert _fast_path(out)["gpu_decode"] is (setting == "on")
        m = _metrics(out)
        _assert_learned(m)
        finals[setting] = m["final"]
    assert finals["off"]["val_top1"] > 0.9, finals
    assert abs(finals["on"]["val_top1"] - finals["off"]["val_top1"]) <= 0.05, finals


# --- bf16 autocast on CUDA -----------------------------------------------------------------------


def _train_recording_dtypes(out, model, data, monkeypatch, **options) -> set:
    """Train in this process; -> {("train" or "eval", dtype of the classifier head's output)} of
    the training steps (gradients on) and the evaluations (inference mode)."""
    import kfvision.trainer.train

    dtypes, build = set(), kfvision.trainer.train.build_model

    def record(module, inputs, output):
        # not a set-up probe under no_grad (trainer/model/convgemm.py: train_only_live_taps)
        if torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            dtypes.add(("train" if module.training else "eval", output.dtype))

    def build_model(*args, **kwargs):
        net = build(*args, **kwargs)
        net.fc.register_forward_hook(record)
        return net

    with monkeypatch.context() as m:
        m.setattr(kfvision.trainer.train, "build_model", build_model)
        assert main(train_argv(model, data, out, device="cuda", **DIGITS, **options)) == 0
    return dtypes


@pytest.mark.skipif(GPUS > 0 and not torch.cuda.is_bf16_supported(),
                    reason="this GPU has no bf16 (before Ampere)")
def test_amp_auto_on_cuda_trains_in_bf16_to_fp32s_accuracy(tmp_path, resnet18_dir, digits,
                                                           monkeypatch):
    bf16 = _train_recording_dtypes(tmp_path / "bf16", resnet18_dir, digits, monkeypatch,
                                   amp="auto")
    fp32 = _train_recording_dtypes(tmp_path / "fp32", resnet18_dir, digits, monkeypatch,
                                   amp="off")
    assert bf16 == {("train", torch.bfloat16), ("eval", torch.bfloat16)}, bf16
    assert fp32 == {("train", torch.float32), ("eval", torch.float32)}, fp32
    rt = _fast_path(tmp_path / "bf16")
    assert rt["amp"] is True and rt["amp_reason"] == "CUDA" and rt["channels_last"] is True
    assert _fast_path(tmp_path / "fp32")["amp"] is False
    a, b = _metrics(tmp_path / "bf16"), _metrics(tmp_path / "fp32")
    _assert_learned(a)
    _assert_learned(b)
    assert b["final"]["val_top1"] > 0.9, b["final"]
    # the CPU's bf16 test allows 0.03; each GPU run also differs a little by cuDNN's choices
    assert abs(a["final"]["val_top1"] - b["final"]["val_top1"]) <= 0.05, (a["final"], b["final"])


# --- kfvision serve --device cuda ----------------------------------------------------------------

# the lent GPU machines have no kserve, and nothing is carried there but the repository
needs_kserve = pytest.mark.skipif(importlib.util.find_spec("kserve") is None,
                                  reason="kserve is not installed (pip install kserve)")


def _files(data_dir) -> tuple[list, list]:
    imdir = read_image_directory(data_dir)
    return [e.path for e in imdir.images], [(data_dir / e.path).read_bytes()
                                            for e in imdir.images]


def test_the_cuda_predictor_gives_the_cpu_predictors_probabilities(trained_tiny, digits_640):
    cuda, cpu = Predictor(trained_tiny, device="cuda"), Predictor(trained_tiny)
    assert cuda.device.type == "cuda"
    _, files = _files(digits_640)
    batch = torch.stack([cpu.preprocess(f) for f in files])
    a, b = cuda.probabilities(batch), cpu.probabilities(batch)
    assert abs(a - b).max() < 5e-3  # TF32 convolutions
    assert (a.argmax(1) == b.argmax(1)).mean() >= 0.95


@needs_kserve
def test_serve_on_cuda_answers_v2_requests_with_the_cpu_scores(trained_tiny, digits_640,
                                                                tmp_path):
    score(trained_tiny, digits_640, tmp_path / "scored.csv", progress=False)
    rows = list(csv.DictReader((tmp_path / "scored.csv").open()))
    paths, files = _files(digits_640)
    assert [r["image"] for r in rows] == paths
    server = Server(["--model", trained_tiny, "--name", "digits", "--device", "cuda",
                     "--max-batch-size", "8"], tmp_path / "server.log")
    try:
        status, body = request(f"{server.url}/v2/models/digits/infer", v2_body(files))
    finally:
        server.stop()
    assert status == 200, body
    out = {o["name"]: o for o in body["outputs"]}
    n = len(files)
    assert out["probabilities"]["shape"] == [n, 10] and len(out["label"]["data"]) == n
    probs = torch.tensor(out["probabilities"]["data"]).reshape(n, 10)
    classes = read_image_directory(digits_640).classes
    scored = torch.tensor([[float(r[f"scored_probability_{c}"]) for c in classes] for r in rows])
    assert (probs - scored).abs().max() < 5e-3  # TF32 convolutions, batches of other sizes
    same = sum(a == r["scored_label"] for a, r in zip(out["label"]["data"], rows))
    assert same >= 0.95 * n, (same, n)


# --- bench/gpu.sh (make bench-gpu), in small ------------------------------------------------------


def test_the_gpu_benchmark_runs_every_row_in_small(tmp_path):
    """bench/gpu.sh's rows (the step alone, the plain loop, kfvision's default and its batched
    GPU pipeline) at the smoke preset's sizes on CUDA, run in tmp_path (its results go to
    build/bench/ under the working directory: a real run's tables stay as they are)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke", "--device", "cuda",
                          "--step-variants", "channels-last", "graphs"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = (tmp_path / "build" / "bench" / "gpu-cuda.md").read_text()
    rows = {r.split("|")[1].strip(): r for r in table.splitlines() if r.startswith("| ")}
    for name in ("step only", "plain loop", "kfvision, defaults", "kfvision `--cache off`"):
        row = next((r for k, r in rows.items() if k.startswith(name)), None)
        assert row is not None and float(row.split("|")[2]) > 0, (name, table)
    step = json.loads((tmp_path / "build" / "bench" / "step-cuda.json").read_text())
    assert set(step["all"]) == {"channels-last", "graphs"}
    assert all("images_per_sec" in r for r in step["all"].values()), step  # graphs captured
