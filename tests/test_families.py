"""The whole flow for one small model of each torchvision family, in this process: model ->
train 1 epoch -> score -> export ONNX (checked in onnxruntime) -> serve one v1 request (KServe's
model, called as its server calls it). The data (micro_digits) is made once a session; each
family trains at the smallest size of the catalog's probe grid it takes (>= 32 px)."""

import asyncio
import base64
import csv

import pytest
from helpers.runs import train_argv

from kfvision.trainer.model.catalog import FAMILIES, PARAMS, SIZES

# the smallest model of each family (fewest parameters): generated, like the catalog
SMALLEST = {family: min(names, key=PARAMS.__getitem__) for family, names in FAMILIES.items()}


def _size(arch: str) -> int:
    return min(s for s in SIZES[arch] if s >= 32)


def test_every_family_has_a_smallest_model_that_fits_some_size():
    assert len(SMALLEST) == len(FAMILIES) >= 17 and set(IN_MAKE_TEST) <= set(FAMILIES)
    assert SMALLEST["resnet"] == "resnet18" and SMALLEST["vision_transformer"] == "vit_b_16"


def _serve_one(model_dir, image: bytes) -> dict:
    from kfvision.pipelines.serve.server import build_model

    classifier = build_model(model_dir, name="flow", max_batch_size=2, max_queue=4)
    try:
        payload = {"instances": [{"image": {"b64": base64.b64encode(image).decode()}}]}
        return asyncio.run(classifier.predict(payload))
    finally:
        classifier.stop()


# `make test` runs two families whose heads differ from ResNet's fc (classifier[-1]; a convolution
# as the classifier) at a few seconds each; ResNet's flow is the one the rest of the suite runs
# (resnet18: trained, scored, exported and served in tests/cli, tests/trainer, tests/serve); the
# others, up to minutes of ONNX export each on 2 cores, run in `make test-stress` (the flow is the
# same code for every family)
IN_MAKE_TEST = ("mobilenetv3", "squeezenet")


@pytest.mark.slow
@pytest.mark.parametrize("family", [f if f in IN_MAKE_TEST else
                                    pytest.param(f, marks=pytest.mark.stress)
                                    for f in sorted(FAMILIES)])
def test_model_train_score_export_serve(family, micro_digits, tmp_path):
    from kfvision.trainer.model.arch import write_untrained_model
    from kfvision.trainer.train import main
    from kfvision.trainer.use.export import check_export, export
    from kfvision.trainer.use.score import score

    arch, size = SMALLEST[family], _size(SMALLEST[family])
    write_untrained_model(tmp_path / "model", arch)
    assert main(train_argv(tmp_path / "model", micro_digits, tmp_path / "trained", epochs=1,
                           image_size=size, batch_size=8, lr=0.01, augment="none",
                           print_freq=100, workers=0)) == 0
    score(tmp_path / "trained", micro_digits["val"], tmp_path / "scored.csv", batch_size=16)
    rows = list(csv.DictReader((tmp_path / "scored.csv").open()))
    assert len(rows) == 10
    export(tmp_path / "trained", "onnx", tmp_path / "m.onnx")
    checked = check_export(tmp_path / "trained", tmp_path / "m.onnx", "onnx", micro_digits["val"])
    assert checked["images"] == 10 and checked["max_abs_diff"] < 1e-3
    first = next((micro_digits["raw"] / "val").glob("*/*"))
    answer = _serve_one(tmp_path / "trained", first.read_bytes())
    assert len(answer["predictions"]) == 1
    classes = {p.name for p in (micro_digits["raw"] / "val").iterdir()}
    assert {r["scored_label"] for r in rows} <= classes
    assert answer["predictions"][0]["label"] in classes
