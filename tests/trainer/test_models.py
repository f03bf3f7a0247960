"""Every architecture of torchvision's list; the untrained model directory and its errors."""

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


def test_the_catalog_is_torchvisions_whole_list_by_family():
    """trainer/model/catalog.py is generated (`make catalog`) from the installed torchvision."""
    from kfvision.trainer.model import catalog

    listed = torchvision.models.list_models(module=torchvision.models)
    assert sorted(a for _, a in ALL) == sorted(listed)
    assert torchvision.__version__.split("+")[0] == catalog.TORCHVISION
    for family, arch in ALL:
        assert torchvision.models.get_model_builder(arch).__module__.endswith("." + family)
    azure = {"resnet18", "resnet152", "resnext101_32x8d", "wide_resnet101_2"}
    assert azure <= set(ARCHITECTURES["resnet"]) and "densenet161" in ARCHITECTURES["densenet"]


def _smallest_of_each_family():
    from kfvision.trainer.model.catalog import PARAMS

    return [(f, min(names, key=PARAMS.__getitem__)) for f, names in ARCHITECTURES.items()]


def test_every_architecture_takes_some_size_of_the_probe_grid():
    from kfvision.trainer.model.catalog import SIZES

    assert all(SIZES[arch] for _, arch in ALL)  # the catalog's probe: a forward at 1000 classes


@pytest.mark.parametrize("family, arch", _smallest_of_each_family())
def test_each_family_gets_a_head_for_the_classes_at_its_smallest_size(family, arch):
    """On the meta device (shapes only, in milliseconds): the head found generically is what
    the classes size, and the output has one logit per class."""
    from kfvision.trainer.model import catalog
    from kfvision.trainer.model.arch import _kwargs, head_keys

    size = catalog.SIZES[arch][0]
    with torch.device("meta"):
        try:
            model = torchvision.models.get_model(arch, num_classes=7,
                                                 **_kwargs(ModelSpec(family, arch), size))
        except NotImplementedError:  # RegNet computes its widths on tensors
            model = None
    if model is None:
        model = build_model(ModelSpec(family, arch), 7, image_size=size).to("meta")
    state = model.state_dict()
    assert head_keys(arch) and all(state[k].shape[0] == 7 for k in head_keys(arch))
    out = model.eval()(torch.empty(2, 3, size, size, device="meta"))
    assert out.shape == (2, 7)


def test_resnet_zero_init_residual_and_densenet_memory_efficient_take_effect(tmp_path):
    spec = write_untrained_model(tmp_path / "r", "resnet50", zero_init_residual=True)
    model = build_model(spec, 3)
    assert all(torch.count_nonzero(b.bn3.weight) == 0 for b in model.layer1)
    spec = write_untrained_model(tmp_path / "d", "densenet121", memory_efficient=True)
    model = build_model(spec, 3)
    assert model.features.denseblock1.denselayer1.memory_efficient
    model(torch.randn(2, 3, 32, 32)).sum().backward()  # checkpointed backward works


def test_dropout_and_stochastic_depth_reach_the_model(tmp_path):
    spec = write_untrained_model(tmp_path / "e", "efficientnet_b0", dropout=0.5,
                                 stochastic_depth=0.3)
    assert read_model_spec(tmp_path / "e") == spec
    model = build_model(spec, 3)
    assert model.classifier[0].p == 0.5
    assert max(m.p for m in model.modules() if type(m).__name__ == "StochasticDepth") > 0.2


@pytest.mark.parametrize("arch, option, takers", [
    ("densenet169", {"zero_init_residual": True}, "resnet"),
    ("resnet18", {"memory_efficient": True}, "densenet"),
    ("resnet50", {"dropout": 0.2}, "efficientnet"),
    ("vit_b_16", {"stochastic_depth": 0.1}, "convnext"),
])
def test_an_option_the_family_lacks_is_refused_by_name(tmp_path, arch, option, takers):
    from kfvision.trainer.errors import FamilyOptionError

    with pytest.raises(FamilyOptionError, match=f"not an option of {arch}.*{takers}"):
        write_untrained_model(tmp_path / "m", arch, **option)
    assert not (tmp_path / "m").exists()


def test_unknown_name_names_the_closest_and_where_the_list_is(tmp_path):
    with pytest.raises(InvalidParameterError, match="closest: resnet18.*docs/models.md lists them"):
        write_untrained_model(tmp_path / "m", "resnet19")


@pytest.mark.parametrize("arch, size, fits", [
    ("maxvit_t", 224, True), ("maxvit_t", 64, False), ("inception_v3", 64, False),
    ("vit_b_16", 32, True), ("vit_h_14", 32, False), ("swin_t", 64, True),
])
def test_an_image_size_the_model_cannot_take_is_refused_clearly(arch, size, fits):
    from kfvision.trainer.errors import ImageSizeError
    from kfvision.trainer.model.arch import check_image_size

    spec = ModelSpec("", arch)
    if fits:
        check_image_size(spec, size)
        return
    with pytest.raises(ImageSizeError, match=f"{arch} cannot take --image-size {size}.*"
                       "Sizes it takes include [0-9]"):
        check_image_size(spec, size)


@pytest.mark.slow  # 3.5-5 s of CPU measured: near the unmarked limit
def test_vit_weights_of_another_size_are_resized_to_the_training_size(tmp_path):
    source = torchvision.models.vit_b_16(image_size=32)
    torch.save(source.state_dict(), tmp_path / "vit.pth")
    spec = write_untrained_model(tmp_path / "m", "vit_b_16", weights=tmp_path / "vit.pth")
    model = build_model(spec, 3, tmp_path / "m", image_size=64)
    assert model.encoder.pos_embedding.shape[1] == 1 + 16
    assert torch.equal(model.conv_proj.weight, source.conv_proj.weight)


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
    with pytest.raises(InvalidModelDirectoryError, match="kfvision model resnet18"):
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
