"""int8 on CPU: the forward pass of ResNet-18 (224 px) quantized two ways, against fp32.

The model is bench.serve's (random weights, ImageNet evaluation preset); it is exported to ONNX
with `kfvision.trainer.use.export.export` and quantized, after calibration on `--calibration`
generated JPEGs (bench/jpegset.py) preprocessed as serving preprocesses them, by

  ort-int8   onnxruntime `quantize_static`: QDQ, per-channel, u8 activations / s8 weights
             (`kfvision.trainer.use.quantize.quantize_onnx`, what `kfvision export --quantize int8`
             does)
  ov-int8    OpenVINO with NNCF (`nncf.quantize` on the model OpenVINO reads from the ONNX file;
             nncf is no kfvision dependency: `pip install nncf` for this row, else it is left out)
  ov-qdq     OpenVINO running ort-int8's QDQ file (what `kfvision serve` runs it on)

and timed beside fp32 PyTorch, fp32 onnxruntime and fp32 OpenVINO, each on ONE intra-op
thread (a server runs one single-threaded forward per core), on uint8 [n, 3, 224, 224]
batches, n = 1 and 8. OpenVINO runs the operations that are not int8 in f32, as Predictor has
it. Rounds rotate the contenders' order; within a round each runs `--seconds` per batch size.
The table gives images/s (median over rounds) and the median ratio to fp32 PyTorch taken within
each round (the machine may be shared: ratios in one run are what to compare). `agree` is top-1
agreement with fp32 PyTorch on held-out generated images and `max dp` the largest probability
difference from it (random weights: they measure the quantization's damage, not accuracy;
tests/trainer/test_export_int8.py checks accuracy on a trained model).

A second table times the serving path itself, `Predictor.probabilities` with one intra-op thread,
called by 1 and by as many threads as there are CPUs at once (the server runs one forward per
core): torch on the model directory, the int8 file on onnxruntime and on OpenVINO.

    python -m bench.int8 [--rounds 5 --seconds 2 --batches 1 8 --calibration 200]
"""

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

import bench
from bench.jpegset import make_jpeg_set
from bench.serve import bench_model
from kfvision.trainer.fastpath import int8_reduce_range
from kfvision.trainer.use.quantize import quantize_onnx

BENCH = bench.BENCH / "int8"


def _images(data_dir: Path) -> np.ndarray:
    """Every image of an image directory as served: the eval transform, uint8 NCHW."""
    from kfvision.trainer.data.datasets import ImageDataset
    from kfvision.trainer.data.imagedir import read_image_directory
    from kfvision.trainer.data.transforms import eval_transform

    ds = ImageDataset(read_image_directory(data_dir), eval_transform("standard", 224))
    return torch.stack([ds[i][0] for i in range(len(ds))]).numpy()


def quantize_nncf(fp32: Path, calib: np.ndarray, out: Path) -> None:
    import nncf
    import openvino as ov

    model = ov.Core().read_model(str(fp32))
    q = nncf.quantize(model, nncf.Dataset(list(calib), lambda x: x[None]),
                      subset_size=len(calib))
    ov.save_model(q, str(out))


def ort_runner(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    s = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return lambda x: s.run(None, {"image": x})[0]


def ov_runner(path: Path):
    import openvino as ov

    # f32 where not int8, as Predictor compiles it (OpenVINO would pick bf16 on a CPU with AMX)
    config = {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": "f32"}
    compiled = ov.Core().compile_model(str(path), "CPU", config)
    req = compiled.create_infer_request()
    return lambda x: next(iter(req.infer({0: x}).values()))


def torch_runner(model_dir: Path):
    from kfvision.trainer.model.trained import load_trained_model
    from kfvision.trainer.use.export import ServingModel

    net, info = load_trained_model(model_dir)
    wrapped = ServingModel(net, info["mean"], info["std"]).eval()

    def run(x):
        with torch.inference_mode():
            return wrapped(torch.from_numpy(x)).numpy()

    return run


def _rate(run, x: np.ndarray, seconds: float, callers: int = 1) -> float:
    """Images/s of `callers` threads each calling run(x) back to back for `seconds`."""
    run(x)  # warm-up (first-call allocations, kernel selection)
    counts, stop = [0] * callers, time.perf_counter() + seconds

    def work(i):
        while time.perf_counter() < stop:
            run(x)
            counts[i] += len(x)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(callers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def _measure(runners: dict, a, callers: int = 1) -> dict:
    """{(name, n): [images/s per round]}, the contenders' order rotating round by round."""
    names, rng = list(runners), np.random.default_rng(0)
    rates = {(k, n): [] for k in names for n in a.batches}
    for r in range(a.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            for n in a.batches:
                x = rng.integers(0, 256, (n, 3, 224, 224), dtype=np.uint8)
                rates[k, n].append(_rate(runners[k], x, a.seconds, callers))
        print(f"round {r + 1}/{a.rounds} done ({callers} caller(s))", flush=True)
    return rates


def _rows(rates: dict, names, batches, baseline: str, extra=lambda k: []) -> list[str]:
    head = " | ".join(f"n={n} images/s | n={n} x {baseline}" for n in batches)
    lines = [f"| runtime | {head} |" + "".join(f" {c} |" for c in extra(None)),
             "|---" * (2 * len(batches) + 1 + len(extra(None))) + "|"]
    for k in names:
        cells = []
        for n in batches:
            ratio = [x / b for x, b in zip(rates[k, n], rates[baseline, n])]
            cells += [f"{statistics.median(rates[k, n]):.1f}",
                      f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})"]
        lines.append(f"| {k} | " + " | ".join(cells + extra(k)) + " |")
    return lines


def predictors(model: Path, int8: Path) -> dict:
    """The serving path: Predictor.probabilities, one intra-op thread per caller."""
    from kfvision.trainer.use.predict import Predictor

    ps = {"torch-fp32": Predictor(model, threads=1),
          "onnx-int8": Predictor(int8, runtime="onnx", threads=1),
          # named: this file is quantize_onnx's alone, without the metadata export_int8 adds
          "openvino-int8": Predictor(int8, runtime="openvino", threads=1)}
    return {k: (lambda x, p=p: p.probabilities(torch.from_numpy(x))) for k, p in ps.items()}


def build(work: Path, calibration: int, held_out: int) -> tuple[dict, np.ndarray]:
    from kfvision.trainer.use.export import export

    model = bench_model(work / "model")
    data = _images(make_jpeg_set(work / "jpegs", images=calibration + held_out))
    calib, test = data[:calibration], data[calibration:]
    fp32 = work / "fp32.onnx"
    if not fp32.exists():
        export(model, "onnx", fp32)
    t = time.perf_counter()
    # the weights' width for this CPU, as `kfvision export` picks it (7-bit without VNNI)
    quantize_onnx(fp32, work / "ort-int8.onnx", calib, progress=False,
                  reduce_range=int8_reduce_range())
    print(f"ort quantize_static: {time.perf_counter() - t:.0f} s", flush=True)
    runners = {"torch-fp32": torch_runner(model), "ort-fp32": ort_runner(fp32),
               "ov-fp32": ov_runner(fp32), "ort-int8": ort_runner(work / "ort-int8.onnx"),
               "ov-qdq": ov_runner(work / "ort-int8.onnx")}
    try:
        t = time.perf_counter()
        quantize_nncf(fp32, calib, work / "ov-int8.xml")
        print(f"nncf.quantize: {time.perf_counter() - t:.0f} s", flush=True)
        runners["ov-int8"] = ov_runner(work / "ov-int8.xml")
    except ImportError as e:
        print(f"no ov-int8 row: {e} (pip install nncf)", flush=True)
    return runners, test


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2, help="per contender, batch size, round")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--calibration", type=int, default=200, help="calibration images")
    p.add_argument("--held-out", type=int, default=200, help="images for `agree`")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    runners, test = build(BENCH, a.calibration, a.held_out)
    ref = np.concatenate([runners["torch-fp32"](test[i:i + 8]) for i in range(0, len(test), 8)])
    agree, diff = {}, {}
    for k, run in runners.items():
        out = np.concatenate([run(test[i:i + 8]) for i in range(0, len(test), 8)])
        agree[k] = float((out.argmax(1) == ref.argmax(1)).mean())
        diff[k] = float(np.abs(out - ref).max())
    names = list(runners)
    rates = _measure(runners, a)
    lines = [f"int8 forward, 1 thread, {os.cpu_count()} CPUs, median of {a.rounds} rounds x "
             f"{a.seconds:g} s; agree = top-1 agreement with torch-fp32 on {len(test)} images, "
             f"max dp = largest probability difference from it", ""]
    lines += _rows(rates, names, a.batches, "torch-fp32",
                   lambda k: ["agree", "max dp"] if k is None else
                   [f"{agree[k]:.3f}", f"{diff[k]:.2g}"])
    serving = predictors(BENCH / "model", BENCH / "ort-int8.onnx")
    for callers in sorted({1, os.cpu_count() or 1}):
        rates = _measure(serving, a, callers)
        lines += ["", f"Predictor.probabilities (threads=1), {callers} concurrent caller(s), "
                  f"median of {a.rounds} rounds x {a.seconds:g} s", ""]
        lines += _rows(rates, list(serving), a.batches, "torch-fp32")
    bench.publish("\n".join(lines), "int8.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
