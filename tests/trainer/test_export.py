"""kfvision export: ONNX (onnxruntime), TorchScript and torch.export give PyTorch's predictions,
and carry the class list and preprocessing with them."""

import csv
import json

import numpy as np
import pytest
import torch

from kfvision.pipelines.cli import main
from kfvision.trainer.data.datasets import ImageDataset
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.data.transforms import eval_transform
from kfvision.trainer.errors import InvalidModelDirectoryError, InvalidParameterError
from kfvision.trainer.model.trained import load_trained_model
from kfvision.trainer.use.export import FORMATS, check_export, export, load_exported


@pytest.fixture(scope="module")
def exports(trained_tiny, trained_tiny_onnx, tmp_path_factory) -> dict:
    """One export per format of the tiny trained model (exporting is the slow part; ONNX's is
    shared with test_serve.py)."""
    out = tmp_path_factory.mktemp("exports")
    return {fmt: trained_tiny_onnx if fmt == "onnx" else
            (out / f"model.{fmt}", export(trained_tiny, fmt, out / f"model.{fmt}"))
            for fmt in FORMATS}


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_predicts_what_pytorch_predicts_on_real_images(exports, trained_tiny,
                                                              tiny_digits, fmt):
    path, _ = exports[fmt]
    r = check_export(trained_tiny, path, fmt, tiny_digits["val"])
    assert r["images"] == 60 and r["top1_agree"] == 60
    assert r["max_abs_diff"] < 1e-4


@pytest.mark.parametrize("fmt", FORMATS)
def test_class_list_and_preprocessing_travel_with_the_export(exports, trained_tiny, fmt):
    path, written = exports[fmt]
    _, meta = load_exported(path, fmt)
    _, info = load_trained_model(trained_tiny)
    assert meta == written
    assert meta["classes"] == info["classes"] and meta["image_size"] == info["image_size"] == 32
    assert meta["normalization"]["mean"] == info["mean"]
    assert meta["normalization"]["std"] == info["std"]
    assert meta["preprocess"] == [{"op": "resize", "size": [32, 32], "antialias": True,
                                   "interpolation": "bilinear"}]  # eval preset "none"
    assert meta["input"] == {"name": "image", "dtype": "uint8", "shape": ["batch", 3, 32, 32],
                             "layout": "NCHW, RGB, 0-255"}


def test_onnx_in_onnxruntime_alone_reproduces_the_scored_table(exports, trained_tiny,
                                                               tiny_digits, tmp_path):
    """A serving stack with only onnxruntime, numpy and the metadata gets score()'s labels."""
    import onnxruntime as ort

    from kfvision.trainer.use.score import score

    score(trained_tiny, tiny_digits["val"], tmp_path / "s.csv", progress=False)
    expected = [r["scored_label"] for r in csv.DictReader((tmp_path / "s.csv").open())]
    session = ort.InferenceSession(str(exports["onnx"][0]), providers=["CPUExecutionProvider"])
    meta = json.loads(session.get_modelmeta().custom_metadata_map["kfvision"])
    imdir = read_image_directory(tiny_digits["val"])
    ds = ImageDataset(imdir, eval_transform(meta["eval_preset"], meta["image_size"]))
    for batch in (range(0, 7), range(7, 60)):  # the batch size is dynamic
        images = np.stack([ds[i][0].numpy() for i in batch])
        probs = session.run(["probabilities"], {"image": images})[0]
        assert probs.shape == (len(batch), len(meta["classes"]))
        assert np.allclose(probs.sum(axis=1), 1, atol=1e-5)
        assert [meta["classes"][k] for k in probs.argmax(axis=1)] == [expected[i] for i in batch]


def test_unknown_format_and_untrained_model_are_named_errors(trained_tiny, resnet18_dir,
                                                             tmp_path):
    with pytest.raises(InvalidParameterError, match="onnx, torchscript, torch-export"):
        export(trained_tiny, "tflite", tmp_path / "m.tflite")
    with pytest.raises(InvalidModelDirectoryError, match="not a trained model directory"):
        export(resnet18_dir, "onnx", tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_leaves_nothing(trained_tiny, tmp_path, monkeypatch):
    from kfvision.trainer.errors import ExportError
    from kfvision.trainer.use import export as export_module

    def broken(wrapped, sample, meta, path):
        path.write_bytes(b"half a model")
        raise ExportError("exporter failed")

    monkeypatch.setitem(export_module.SAVERS, "onnx", broken)
    with pytest.raises(ExportError, match="exporter failed"):
        export(trained_tiny, "onnx", tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_an_export_that_disagrees_with_pytorch_is_refused(trained_tiny, tmp_path, monkeypatch):
    from kfvision.trainer.errors import ExportError
    from kfvision.trainer.use import export as export_module

    real = export_module.SAVERS["torch-export"]

    def skewed(wrapped, sample, meta, path):
        with torch.no_grad():
            wrapped.model.fc.bias += 5 * torch.arange(len(meta["classes"]), dtype=torch.float32)
        real(wrapped, sample, meta, path)
        with torch.no_grad():  # the reference is the unchanged model
            wrapped.model.fc.bias -= 5 * torch.arange(len(meta["classes"]), dtype=torch.float32)

    monkeypatch.setitem(export_module.SAVERS, "torch-export", skewed)
    with pytest.raises(ExportError, match="differs from PyTorch"):
        export(trained_tiny, "torch-export", tmp_path / "m.pt2")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # 3.5-5 s of CPU measured: near the unmarked limit
def test_cli_export_with_check(trained_tiny, tiny_digits, tmp_path, capsys):
    out = tmp_path / "m.pt2"
    argv = ["export", "--model", str(trained_tiny), "--format", "torch-export", "--out", str(out),
            "--check", str(tiny_digits["val"]), "--check-limit", "20"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "input 'image' uint8 [batch, 3, 32, 32]" in text and "over 10 classes" in text
    assert "top-1 agrees on 20/20" in text and out.is_file()
    assert main(["export", "--model", str(tmp_path), "--out", str(tmp_path / "x.onnx")]) == 2
    assert "not a trained model directory" in capsys.readouterr().err
