"""Every architecture the Azure modules offer; the untrained model directory and its errors."""

import json
from pathlib import Path

import pytest
import torch
import torchvision

from kfvision.trainer.errors import InvalidModelDirectoryError, InvalidParameterError
from kfvision.trainer.model.arch import build_model, write_untrained_model
from kfvision.trainer.model.spec import SPEC_FILE, ModelSpec, read_model_spec
from kfvision.trainer.presets import ARCHITECTURES

ALL = [(family, arch) for family, names in ARCHITECTURES.items() for arch in names]


def test_the_azure_architectures_are_all_there():
    assert len(ALL) == 13
    assert {"resnext101_32x8d", "wide_resnet101_2", "densenet161"} <= {a for _, a in ALL}


@pytest.mark.parametrize("family, arch", ALL)
def test_every_architecture_builds_with_a_head_for_the_classes_and_runs(family, arch):
    model = build_model(ModelSpec(family, arch), num_classes=7).eval()
    with torch.inference_mode():
        out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 7)


def test_resnet_zero_init_residual_and_densenet_memory_efficient_take_effect(tmp_path):
    spec = write_untrained_model(tmp_path / "r", "resnet50", zero_init_residual=True)
    model = build_model(spec, 3)
    assert all(torch.count_nonzero(b.bn3.weight) == 0 for b in model.layer1)
    spec = write_untrained_model(tmp_path / "d", "densenet121", memory_efficient=True)
    model = build_model(spec, 3)
    assert model.features.denseblock1.denselayer1.memory_efficient
    model(torch.randn(2, 3, 32, 32)).sum().backward()  # checkpointed backward works


def test_spec_round_trips_and_options_of_the_other_family_are_dropped(tmp_path):
    spec = write_untrained_model(tmp_path / "m", "densenet169", zero_init_residual=True)
    assert read_model_spec(tmp_path / "m") == spec
    assert spec.family == "densenet" and not spec.zero_init_residual


def test_unknown_name_lists_the_valid_names(tmp_path):
    with pytest.raises(InvalidParameterError, match="resnet18, resnet34.*densenet201"):
        write_untrained_model(tmp_path / "m", "vgg16")


def test_local_weights_become_the_backbone_and_the_head_is_resized(tmp_path):
    source = torchvision.models.resnet18(num_classes=1000)
    torch.save(source.state_dict(), tmp_path / "r18.pth")
    spec = write_untrained_model(tmp_path / "m", "resnet18", weights=tmp_path / "r18.pth")
    model = build_model(spec, 4, tmp_path / "m")
    assert torch.equal(model.conv1.weight, source.conv1.weight)
    assert model.fc.out_features == 4


def test_weights_of_another_architecture_are_refused(tmp_path):
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "r18.pth")
    with pytest.raises(InvalidModelDirectoryError, match="does not fit resnet50"):
        write_untrained_model(tmp_path / "m", "resnet50", weights=tmp_path / "r18.pth")
    assert not (tmp_path / "m").exists()


def test_a_file_that_is_not_a_state_dict_is_refused(tmp_path):
    (tmp_path / "w.pth").write_text("hello")
    with pytest.raises(InvalidModelDirectoryError, match="not a loadable state_dict"):
        write_untrained_model(tmp_path / "m", "resnet18", weights=tmp_path / "w.pth")


def test_pretrained_without_network_or_cache_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(InvalidModelDirectoryError, match="copy that file there by hand"):
        write_untrained_model(tmp_path / "m", "resnet18", pretrained=True)
    assert not (tmp_path / "m").exists()


def test_pretrained_uses_a_warm_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    url = torchvision.models.ResNet18_Weights.DEFAULT.url
    cached = tmp_path / "torch" / "hub" / "checkpoints" / Path(url).name
    cached.parent.mkdir(parents=True)
    source = torchvision.models.resnet18()
    torch.save(source.state_dict(), cached)
    spec = write_untrained_model(tmp_path / "m", "resnet18", pretrained=True)
    assert spec.pretrained and spec.weights
    model = build_model(spec, 10, tmp_path / "m")
    assert torch.equal(model.layer1[0].conv1.weight, source.layer1[0].conv1.weight)


def _spec_doc(root):
    return json.loads((root / SPEC_FILE).read_text())


@pytest.mark.parametrize("damage, message", [
    (lambda root: (root / SPEC_FILE).unlink(), "not a model directory"),
    (lambda root: (root / SPEC_FILE).write_text("[]"), "malformed"),
    (lambda root: (root / SPEC_FILE).write_text(json.dumps({**_spec_doc(root), "arch": "vgg"})),
     "unknown architecture"),
    (lambda root: (root / SPEC_FILE).write_text(json.dumps({**_spec_doc(root), "weights": "w.pt"})),
     "is missing"),
    (lambda root: (root / SPEC_FILE).write_text(json.dumps({**_spec_doc(root), "extra": 1})),
     "malformed"),
])
def test_a_folder_that_is_not_an_untrained_model_is_refused(tmp_path, damage, message):
    write_untrained_model(tmp_path / "m", "resnet18")
    damage(tmp_path / "m")
    with pytest.raises(InvalidModelDirectoryError, match=message):
        read_model_spec(tmp_path / "m")


def test_an_image_directory_is_not_a_model_directory(tiny_digits):
    with pytest.raises(InvalidModelDirectoryError, match="kfvision model resnet"):
        read_model_spec(tiny_digits["train"])


@pytest.mark.parametrize("damage, message", [
    (lambda root: (root / "weights.pt").unlink(), "needs model.json and weights.pt"),
    (lambda root: (root / "model.json").write_text("[]"), "model.json, is malformed"),
    (lambda root: (root / "model.json").write_text(json.dumps(
        {k: v for k, v in json.loads((root / "model.json").read_text()).items()
         if k != "classes"})), "model.json, is malformed"),
    (lambda root: (root / SPEC_FILE).write_text("[]"), "spec, is malformed"),
    (lambda root: (root / "model.pt").write_bytes(b"") or (root / "model.json").unlink(),
     "has no classes.txt"),
])
def test_the_torch_free_check_and_the_loader_refuse_a_broken_trained_model_alike(
        tmp_path, trained_tiny, damage, message):
    """trainer/model/layout.py's `model_kind` (what score, serve and export call before importing
    torch) says what `load_model` says, in the same words."""
    import shutil

    from kfvision.trainer.model.layout import TRAINED, model_kind
    from kfvision.trainer.model.trained import load_model

    assert model_kind(trained_tiny) == TRAINED
    shutil.copytree(trained_tiny, tmp_path / "m")
    damage(tmp_path / "m")
    with pytest.raises(InvalidModelDirectoryError, match=message) as checked:
        model_kind(tmp_path / "m")
    with pytest.raises(InvalidModelDirectoryError) as loaded:
        load_model(tmp_path / "m")
    assert str(checked.value) == str(loaded.value)
