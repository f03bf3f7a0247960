"""int8 on CPU: an ONNX export quantized with calibration, refused when it loses accuracy.

    kfvision export --model models/trained --format onnx --quantize int8 \\
        --calibrate data/train --check data/val --out model-int8.onnx

onnxruntime's static quantization writes QDQ int8 (per-channel s8 weights, u8 activations
whose ranges come from a sample of the training images, preprocessed as serving preprocesses
them); OpenVINO runs it (`kfvision.trainer.use.predict.openvino_model`), its int8 kernels being
several times onnxruntime's on a CPU (bench/int8.py; docs/serving.md has the figures and why this
pairing). The result is one ONNX file with the same input, output and metadata as the fp32
export, plus `quantization`: the runtime and the top-1 accuracies of both on the check data,
measured on the runtime that serves it, on this CPU's kernels. An int8 model that falls more
than MAX_TOP1_DROP below fp32 is not written.

The weights are 7-bit (`reduce_range`) on a CPU without VNNI, whose int8 kernels add pairs of
u8 x s8 products in 16 bits that full 8-bit weights saturate, and 8-bit where VNNI or AMX
accumulates in 32 bits (`kfvision.trainer.fastpath.int8_reduce_range`). The choice and the CPU are
recorded in `quantization`; a server on a CPU without VNNI refuses an 8-bit export
(`kfvision.trainer.use.predict.check_int8_cpu`).
"""

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from kfvision.trainer.errors import (
    ExportNotSupportedError,
    InvalidDatasetError,
    KfvisionError,
    QuantizationError,
    check_range,
)
from kfvision.trainer.fileio import disk_errors
from kfvision.trainer.progressbar import progress_bar

QUANTIZE = ("none", "int8")  # --quantize
CALIBRATION_IMAGES = 300
MAX_TOP1_DROP = 0.01  # 1 point of top-1 accuracy
RUNTIME = "openvino"


def _dataset(data_dir, meta: dict):
    """The images of `data_dir` as served: the export's eval transform, JPEGs DCT-scaled."""
    from kfvision.trainer.data.datasets import ImageDataset
    from kfvision.trainer.data.imagedir import read_image_directory
    from kfvision.trainer.data.transforms import eval_transform

    imdir = read_image_directory(data_dir)
    transform = eval_transform(meta["eval_preset"], meta["image_size"])
    return imdir, ImageDataset(imdir, transform, dct_scaling=True)


def calibration_images(data_dir, meta: dict, limit: int = CALIBRATION_IMAGES,
                       progress: bool | None = None) -> np.ndarray:
    """uint8 [n, 3, S, S]: a random sample (seed 0) of `limit` images of `data_dir` (all when
    it has fewer), preprocessed as serving preprocesses them."""
    _, ds = _dataset(data_dir, meta)
    if len(ds) == 0:
        raise InvalidDatasetError(f"{data_dir} has no images to calibrate on")
    pick = np.random.default_rng(0).choice(len(ds), min(limit, len(ds)), replace=False)
    return np.stack([ds[int(i)][0].numpy() for i in
                     progress_bar(sorted(pick), "calibration images", "image", progress)])


def quantize_onnx(fp32_path, out, images: np.ndarray, progress: bool | None = None, *,
                  reduce_range: bool = False) -> None:
    """onnxruntime's static quantization of an fp32 ONNX export into `out`: QDQ, per-channel,
    u8 activations (ranges: min-max over `images`) and s8 weights, 7-bit ones with
    `reduce_range` (for CPUs without VNNI: `int8_reduce_range`). Metadata is kept."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter(progress_bar(images, "calibrating", "image", progress))

        def get_next(self):
            x = next(self.batches, None)
            return None if x is None else {"image": x[None]}

    # shape inference and onnxruntime's graph optimisation first (batch norms folded into the
    # convolutions), as onnxruntime's quantization guide asks
    pre = Path(out).with_name(Path(out).name + ".pre.onnx")
    try:
        quant_pre_process(str(fp32_path), str(pre))
        # the logits (the classifier's Gemm output) and the softmax stay float: logits rounded
        # to 8 bits tie close classes (a 0.63 / 0.27 pair came out 0.46 / 0.46), for no speed
        # (10-1000 values an image); the Gemm itself still multiplies in int8
        import onnx

        softmax = [n.name for n in onnx.load(str(pre)).graph.node if n.op_type == "Softmax"]
        quantize_static(str(pre), str(out), Reader(), quant_format=QuantFormat.QDQ,
                        nodes_to_exclude=softmax,
                        extra_options={"OpTypesToExcludeOutputQuantization": ["Gemm"]},
                        per_channel=True, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8, reduce_range=reduce_range)
    finally:
        pre.unlink(missing_ok=True)


def top1(runners: dict, data_dir, meta: dict, *, limit: int | None = None,
         batch_size: int = 32, progress: bool | None = None) -> dict:
    """{name: top-1 accuracy} of each `runners` (uint8 batch -> probabilities) on the labelled
    image directory `data_dir` (a random sample of `limit` images, seed 0: an image directory
    lists its images class by class), and "images": how many."""
    imdir, ds = _dataset(data_dir, meta)
    imdir.require_labelled("the int8 accuracy check (--check)")
    if list(imdir.classes) != list(meta["classes"]):
        raise InvalidDatasetError(f"{data_dir} has classes {list(imdir.classes)} but the model "
                                  f"has {meta['classes']}; check on data with the model's classes")
    order = np.arange(len(ds))
    if limit is not None and limit < len(ds):
        order = np.sort(np.random.default_rng(0).choice(len(ds), limit, replace=False))
    n = len(order)
    correct = dict.fromkeys(runners, 0)
    for start in progress_bar(range(0, n, batch_size), "checking top-1", "batch", progress):
        items = [ds[int(i)] for i in order[start:start + batch_size]]
        batch = torch.stack([x for x, _ in items])
        labels = torch.tensor([y for _, y in items])
        for name, run in runners.items():
            correct[name] += int((run(batch).argmax(1) == labels).sum())
    return {**{k: v / max(n, 1) for k, v in correct.items()}, "images": n}


def _set_metadata(path: Path, meta: dict) -> None:
    import onnx

    from kfvision.trainer.use.export import META_KEY

    proto = onnx.load(str(path))
    entry = next(p for p in proto.metadata_props if p.key == META_KEY)
    entry.value = json.dumps(meta)
    onnx.save(proto, str(path))


def _arch(model_dir) -> str:
    """The architecture errors name: a trained model directory's, else (a script's model) its
    folder."""
    from kfvision.trainer.model.layout import read_trained_model

    try:
        return read_trained_model(Path(model_dir))[1].arch
    except KfvisionError:
        return f"the model in {model_dir}"


@contextlib.contextmanager
def _int8_errors(arch: str):
    """onnxruntime's quantizer or the int8 runtime failing for an architecture, as
    ExportNotSupportedError naming it (as `export` does for a format)."""
    try:
        yield
    except (KfvisionError, OSError):  # ours, and the disk's (disk_errors names those)
        raise
    except Exception as e:  # the quantizer and runtimes raise many types; keep the cause
        first = str(e).splitlines()[0] if str(e) else ""
        raise ExportNotSupportedError(
            f"{arch} cannot be quantized to int8 by this onnxruntime and {RUNTIME} "
            f"({type(e).__name__}: {first}). Export it without quantization (--quantize none): "
            "onnx, torchscript or torch-export.") from e


def export_int8(model_dir, out, calibrate, check, *, calibration: int = CALIBRATION_IMAGES,
                check_limit: int | None = None, progress: bool | None = None) -> dict:
    """Export `model_dir` as int8 ONNX into `out`; returns its metadata (with `quantization`).

    The fp32 export, the calibration on `calibration` images of `calibrate` and the top-1 check
    of both on `check` (`check_limit` of its images; all by default) happen in a temporary
    folder beside `out`; only an int8 model within MAX_TOP1_DROP of fp32 is renamed into place.

    Raises:
        QuantizationError: int8 top-1 below fp32's by more than MAX_TOP1_DROP (nothing written).
        ExportNotSupportedError: onnxruntime's quantizer or the int8 runtime fails for the
            architecture (named).
        InvalidDatasetError: `calibrate` has no images; `check` is unlabelled or has other
            classes. ExportError, InvalidModelDirectoryError: as `export`.
    """
    from kfvision.trainer.cpus import usable_cpus
    from kfvision.trainer.fastpath import cpu_features, int8_reduce_range
    from kfvision.trainer.use.export import export
    from kfvision.trainer.use.predict import LOADERS

    check_range("calibration-images", calibration, 1, 100_000)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        meta = export(model_dir, "onnx", work / "fp32.onnx")
        images = calibration_images(calibrate, meta, calibration, progress)
        cpu = cpu_features()
        reduce_range = int8_reduce_range(cpu)
        arch = _arch(model_dir)
        threads = usable_cpus()
        with _int8_errors(arch):
            quantize_onnx(work / "fp32.onnx", work / "int8.onnx", images, progress,
                          reduce_range=reduce_range)
            int8 = LOADERS[RUNTIME](work / "int8.onnx", threads)[0]
        # int8 on the runtime and kernels that serve it (Predictor's loader, this CPU)
        acc = top1({"fp32": LOADERS["onnx"](work / "fp32.onnx", threads)[0], "int8": int8},
                   check, meta, limit=check_limit, progress=progress)
        if acc["int8"] < acc["fp32"] - MAX_TOP1_DROP:
            raise QuantizationError(
                f"the int8 export of {model_dir} ({arch}) has top-1 {acc['int8']:.2%} on "
                f"{acc['images']} images of {check}, against {acc['fp32']:.2%} in fp32: "
                f"{100 * (acc['fp32'] - acc['int8']):.2f} points lower, more than the "
                f"{100 * MAX_TOP1_DROP:g} allowed; {out} not written. Calibrate on more images "
                f"(--calibration-images, {len(images)} now) or on data more like {check}, or "
                "export without quantization (--quantize none).")
        meta["quantization"] = {"dtype": "int8", "method": "onnxruntime quantize_static, QDQ, "
                                "per-channel s8 weights, u8 activations (min-max)",
                                "reduce_range": reduce_range, "cpu": cpu.to_dict(),
                                "runtime": RUNTIME, "calibration_images": len(images),
                                "top1_fp32": acc["fp32"], "top1_int8": acc["int8"],
                                "val_images": acc["images"]}
        with disk_errors(out):
            _set_metadata(work / "int8.onnx", meta)
        os.chmod(work / "int8.onnx", 0o644)
        os.replace(work / "int8.onnx", out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return meta
