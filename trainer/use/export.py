"""Export a trained model for serving: ONNX, TorchScript, or a torch.export program.

    kfvision export --model models/trained --format onnx --out model.onnx --check data/val

Every format wraps the network the same way, so the artifact needs nothing from kfvision:

    input   "image"          uint8 [batch, 3, S, S], RGB 0-255, already resized as `preprocess` says
    output  "probabilities"  float32 [batch, classes], softmax, classes in `classes` order

Normalisation (mean/std) runs inside the graph, as the trainer runs it on the device. Resizing
stays outside (it depends on the input's size); the metadata says how. The metadata (classes,
image size, preprocessing, mean/std) is stored in the file itself under the key `kfvision`:
ONNX `metadata_props`, TorchScript/torch.export `extra_files` (`kfvision.json`).

A script's model directory (trainer/model/scripted.py) exports the same way where its file still
holds what the exporters trace (`SCRIPT_EXPORTS`).
"""

import io
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from kfvision.trainer.errors import ExportError, ExportNotSupportedError, check_choice
from kfvision.trainer.fileio import disk_errors
from kfvision.trainer.model.trained import load_model

FORMATS = ("onnx", "torchscript", "torch-export")
SUFFIXES = {"onnx": ".onnx", "torchscript": ".pt", "torch-export": ".pt2"}
META_KEY = "kfvision"
EXTRA_FILE = "kfvision.json"
# Fixed rather than the exporter's default (which moves with the torch version): opset 18 loads in
# onnxruntime >= 1.14 and the TensorRT/OpenVINO releases serving stacks still run.
ONNX_OPSET = 18
TOLERANCE = 1e-3  # max |probability difference| accepted between the export and PyTorch
# A script's model file -> the formats it exports to. torch.onnx and torch.export trace the
# Python code of a module: a torch.export program still is one, a TorchScript archive only traces
# into TorchScript again, and an ONNX graph holds no PyTorch at all.
SCRIPT_EXPORTS = {"torch-export": FORMATS, "torchscript": ("torchscript",), "onnx": ()}


class ServingModel(nn.Module):
    """uint8 RGB NCHW batch -> class probabilities (normalisation inside)."""

    def __init__(self, model: nn.Module, mean, std):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1) * 255)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1) * 255)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.model((image.float() - self.mean) / self.std).softmax(dim=1)


def preprocess_steps(eval_preset: str, size: int) -> list[dict]:
    """The resizing the export expects before it (the trainer's eval transform, as data)."""
    if eval_preset == "standard":  # data.transforms.eval_transform: resize to size/0.875, crop
        return [{"op": "resize_shorter_side", "size": int(size / 0.875), "antialias": True,
                 "interpolation": "bilinear"},
                {"op": "center_crop", "size": [size, size]}]
    return [{"op": "resize", "size": [size, size], "antialias": True,
             "interpolation": "bilinear"}]


def export_metadata(info: dict, fmt: str) -> dict:
    """What travels with the export: class list, input contract and preprocessing."""
    size = int(info["image_size"])
    return {
        "format": "kfvision.export", "version": 1, "export_format": fmt,
        "classes": list(info["classes"]), "image_size": size,
        "input": {"name": "image", "dtype": "uint8", "shape": ["batch", 3, size, size],
                  "layout": "NCHW, RGB, 0-255"},
        "output": {"name": "probabilities", "dtype": "float32",
                   "shape": ["batch", len(info["classes"])]},
        "preprocess": preprocess_steps(info["eval_preset"], size),
        "eval_preset": info["eval_preset"],
        "normalization": {"mean": list(info["mean"]), "std": list(info["std"]),
                          "where": "inside the model: (image / 255 - mean) / std"},
    }


def _sample(size: int, n: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))


def _save_onnx(wrapped: nn.Module, sample: torch.Tensor, meta: dict, path: Path) -> None:
    import onnx

    batch = torch.export.Dim("batch", min=1, max=65536)
    program = torch.onnx.export(wrapped, (sample,), input_names=["image"],
                                output_names=["probabilities"], dynamo=True, verbose=False,
                                opset_version=ONNX_OPSET, dynamic_shapes={"image": {0: batch}})
    program.save(str(path), external_data=False)
    proto = onnx.load(str(path))
    entry = proto.metadata_props.add()
    entry.key, entry.value = META_KEY, json.dumps(meta)
    proto.doc_string = f"kfvision export: classes {meta['classes']}"
    onnx.save(proto, str(path))


def _write_zip(save, path: Path) -> None:
    """save(buffer) into memory, then the bytes to `path`: torch's zip writer, given a path (or a
    file for torch.export), aborts the whole process (std::terminate) on a full disk instead of
    raising, so it writes nowhere that can fill."""
    buffer = io.BytesIO()
    save(buffer)
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())


def _save_torchscript(wrapped, sample, meta, path: Path) -> None:
    with warnings.catch_warnings():
        # deprecated, but still what libtorch and Triton's PyTorch backend load
        warnings.simplefilter("ignore", FutureWarning)
        traced = torch.jit.trace(wrapped, sample)
        _write_zip(lambda f: torch.jit.save(traced, f, _extra_files={EXTRA_FILE: json.dumps(meta)}),
                   path)


def _save_torch_export(wrapped, sample, meta, path: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=65536)
    program = torch.export.export(wrapped, (sample,), dynamic_shapes={"image": {0: batch}})
    _write_zip(lambda f: torch.export.save(program, f, extra_files={EXTRA_FILE: json.dumps(meta)}),
               path)


SAVERS = {"onnx": _save_onnx, "torchscript": _save_torchscript,
          "torch-export": _save_torch_export}


def _save(fmt: str, wrapped, meta: dict, path: Path, arch: str) -> None:
    """SAVERS[fmt], a failure of the exporter itself named by architecture and format."""
    try:
        SAVERS[fmt](wrapped, _sample(meta["image_size"]), meta, path)
    except (ExportError, OSError):
        raise
    except Exception as e:  # tracers and exporters raise many types; keep the cause
        others = ", ".join(f for f in FORMATS if f != fmt)
        raise ExportNotSupportedError(
            f"{arch} cannot be exported to {fmt} by this torch ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). Try --format {others}.") from e


def _load(model_dir, fmt: str | None = None):
    """load_model, refusing a script's model that cannot become `fmt`."""
    model, info = load_model(model_dir)
    source = info.get("model_format")
    if fmt is not None and source is not None and fmt not in SCRIPT_EXPORTS[source]:
        can = SCRIPT_EXPORTS[source]
        raise ExportNotSupportedError(
            f"{model_dir}'s {info['model_file']} ({source}) cannot be exported to {fmt}: "
            f"{'it exports only to ' + ', '.join(can) if can else 'it exports to nothing'}, as "
            "the exporters trace Python code it no longer holds. Serve or score the directory "
            "as it is, or have your script write model.pt2 (torch.export), which exports to "
            f"every format.")
    if fmt is not None and getattr(model, "batch", None) is not None:
        raise ExportNotSupportedError(
            f"{model_dir}'s {info['model_file']} takes batches of exactly {model.batch} image(s), "
            "and an export takes any number: have your script export it with a dynamic batch, "
            'e.g. dynamic_shapes={"x": {0: torch.export.Dim("batch")}} (x: the forward\'s '
            "argument).")
    return model, info


def export(model_dir, fmt: str, out) -> dict:
    """Export the trained model in `model_dir` to `out`; returns the metadata stored in it.

    The file is written beside `out` and renamed into place, then loaded back and compared with
    PyTorch on sample inputs (see `check_export` for a check on real images).

    Raises:
        InvalidModelDirectoryError: not a model directory. InvalidParameterError: an unknown
            format. ExportNotSupportedError: a script's model that cannot become `fmt`.
            ExportError: the exporter failed or the export disagrees with PyTorch.
    """
    check_choice("format", fmt, FORMATS)
    model, info = _load(model_dir, fmt)
    wrapped = ServingModel(model, info["mean"], info["std"]).eval().requires_grad_(False)
    meta = export_metadata(info, fmt)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with disk_errors(out):
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=SUFFIXES[fmt], dir=out.parent)
    os.close(fd)
    try:
        with torch.no_grad(), disk_errors(out):  # decided while the half-written file is there
            _save(fmt, wrapped, meta, Path(tmp), info.get("arch", "the model"))
        result = compare(wrapped, load_exported(tmp, fmt)[0], _sample(meta["image_size"], 3))
        if result["max_abs_diff"] > TOLERANCE:
            raise ExportError(
                f"the {fmt} export of {model_dir} differs from PyTorch by "
                f"{result['max_abs_diff']:.3g} (> {TOLERANCE}) on sample inputs; not written.")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; an export is meant to be shared
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return meta


def load_exported(path, fmt: str):
    """(callable: uint8 NCHW tensor -> probabilities tensor, metadata dict) of an export."""
    check_choice("format", fmt, FORMATS)
    path = str(path)
    if fmt == "onnx":
        import onnxruntime as ort

        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        meta = json.loads(session.get_modelmeta().custom_metadata_map[META_KEY])

        def run(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(session.run(None, {"image": x.numpy()})[0])

        return run, meta
    extra = {EXTRA_FILE: ""}
    if fmt == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated; see _save_torchscript
            module = torch.jit.load(path, map_location="cpu", _extra_files=extra)
    else:
        with open(path, "rb") as f:  # a file object: any name works, not only *.pt2
            module = torch.export.load(f, extra_files=extra).module()
    return module, json.loads(extra[EXTRA_FILE])


def compare(reference, exported, images: torch.Tensor) -> dict:
    """Top-1 agreement and the largest probability difference of two models on `images`."""
    with torch.no_grad():
        a, b = reference(images), exported(images)
    return {"images": len(images), "top1_agree": int((a.argmax(1) == b.argmax(1)).sum()),
            "max_abs_diff": float((a - b).abs().max())}


def check_export(model_dir, path, fmt: str, data_dir, *, limit: int = 256,
                 batch_size: int = 32) -> dict:
    """Compare an export with the PyTorch model on (up to `limit`) images of an image directory,
    preprocessed from the export's own metadata. Returns compare()'s figures over all of them.
    """
    from kfvision.trainer.data.datasets import ImageDataset
    from kfvision.trainer.data.imagedir import read_image_directory
    from kfvision.trainer.data.transforms import eval_transform

    model, info = _load(model_dir)
    reference = ServingModel(model, info["mean"], info["std"]).eval()
    exported, meta = load_exported(path, fmt)
    imdir = read_image_directory(data_dir)
    ds = ImageDataset(imdir, eval_transform(meta["eval_preset"], meta["image_size"]))
    n = min(limit, len(ds))
    total = {"images": 0, "top1_agree": 0, "max_abs_diff": 0.0}
    for start in range(0, n, batch_size):
        batch = torch.stack([ds[i][0] for i in range(start, min(start + batch_size, n))])
        r = compare(reference, exported, batch)
        total["images"] += r["images"]
        total["top1_agree"] += r["top1_agree"]
        total["max_abs_diff"] = max(total["max_abs_diff"], r["max_abs_diff"])
    return total
