"""Score an image directory with a trained model (`kfvision train`'s or a script's model directory:
trainer/model/trained.py `load_model`): one CSV row per image.

Columns: `image` (path relative to the image directory), `label` (the true class, only when the
directory is labelled), `scored_label`, then `scored_probability_<class>` for every class in the
model's class order (the names Azure ML designer's Score Image Model uses).
"""

import csv
from pathlib import Path

import torch
from tqdm import tqdm

from kfvision.trainer.data.datasets import ImageDataset, make_loader
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.data.transforms import Normalizer, eval_transform
from kfvision.trainer.errors import InvalidDatasetError, check_range
from kfvision.trainer.fileio import full_disk_error
from kfvision.trainer.model.trained import load_model


def score(model_dir, data_dir, out_csv, *, batch_size: int = 64, workers: int = 0,
          device: str = "cpu", progress: bool | None = None, dct_scaling: bool = True) -> dict:
    """Write the scored table; returns {"rows": n, "accuracy": top-1 or None when unlabelled}.

    `dct_scaling`: decode JPEGs at the reduced scale the evaluation resize allows, as validation
    during training does (`EvalResize`, trainer/data/decode.py).

    Raises:
        InvalidModelDirectoryError: model_dir is not a model directory kfvision reads.
        DeviceError: an ONNX model (a script's) with device "cuda".
        InvalidDatasetError: data_dir is not an image directory, or its classes differ from the
            model's.
    """
    check_range("batch-size", batch_size, 1, 65_536)
    dev = torch.device("cuda" if device == "cuda" else "cpu")
    model, info = load_model(model_dir, device=dev.type)
    classes = info["classes"]
    imdir = read_image_directory(data_dir)
    if imdir.labelled and list(imdir.classes) != classes:
        raise InvalidDatasetError(
            f"{data_dir} has classes {list(imdir.classes)} but the model {model_dir} was trained "
            f"on {classes}. Score data with the model's classes, or convert it without labels."
        )
    normalize = Normalizer(tuple(info["mean"]), tuple(info["std"]))
    ds = ImageDataset(imdir, eval_transform(info["eval_preset"], info["image_size"]),
                      dct_scaling=dct_scaling)
    loader, _ = make_loader(ds, batch_size=batch_size, workers=workers, shuffle=False, seed=0)
    out_csv = Path(out_csv)
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_csv.with_name(f".{out_csv.name}.tmp")
    try:
        correct, rows = _write_rows(tmp, model, loader, normalize, dev, imdir, classes, progress)
    except BaseException as e:
        full = full_disk_error(e, out_csv) if isinstance(e, Exception) else None
        tmp.unlink(missing_ok=True)  # never leave half a table behind
        if full is not None:
            raise full from e
        raise
    tmp.replace(out_csv)
    return {"rows": rows, "accuracy": correct / rows if imdir.labelled else None}


def _write_rows(tmp, model, loader, normalize, dev, imdir, classes, progress) -> tuple[int, int]:
    correct = rows = 0
    with torch.inference_mode(), tmp.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["image"] + (["label"] if imdir.labelled else []) + ["scored_label"]
                   + [f"scored_probability_{c}" for c in classes])
        for images, labels in tqdm(loader, desc="score", unit="batch",
                                   disable=None if progress is None else not progress):
            probs = model(normalize(images.to(dev))).softmax(dim=1).cpu()
            for p, y in zip(probs, labels.tolist()):
                pred = int(p.argmax())
                entry = imdir.images[rows]
                w.writerow([entry.path] + ([classes[y]] if imdir.labelled else [])
                           + [classes[pred]] + [f"{v:.6g}" for v in p.tolist()])
                correct += int(pred == y)
                rows += 1
    return correct, rows
