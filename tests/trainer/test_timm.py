"""timm's models as architectures (`kfvision model timm/NAME`), and without timm installed."""

import json
import sys

import pytest
import torch

from kfvision.trainer.errors import FamilyOptionError, InvalidParameterError
from kfvision.trainer.model.arch import build_model, head_keys, write_untrained_model
from kfvision.trainer.model.spec import read_model_spec

timm = pytest.importorskip("timm")
ARCH = "timm/resnet10t"  # timm's smallest ResNet: builds in milliseconds


def test_a_timm_model_directory_records_timms_version_and_builds_with_a_fresh_head(tmp_path):
    spec = write_untrained_model(tmp_path / "m", ARCH, dropout=0.2, stochastic_depth=0.1)
    assert (spec.family, spec.timm) == ("timm", timm.__version__)
    assert read_model_spec(tmp_path / "m") == spec
    model = build_model(spec, 5).eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 5)
    assert head_keys(ARCH) == {"fc.weight", "fc.bias"} and model.drop_rate == 0.2


def test_local_weights_of_a_timm_model_become_its_backbone(tmp_path):
    source = timm.create_model("resnet10t", num_classes=1000)
    torch.save(source.state_dict(), tmp_path / "w.pth")
    spec = write_untrained_model(tmp_path / "m", ARCH, weights=tmp_path / "w.pth")
    model = build_model(spec, 3, tmp_path / "m")
    assert torch.equal(model.conv1[0].weight, source.conv1[0].weight)


def test_another_installed_timm_warns_naming_both_versions(tmp_path, caplog):
    write_untrained_model(tmp_path / "m", ARCH)
    doc = json.loads((tmp_path / "m" / "spec.json").read_text())
    (tmp_path / "m" / "spec.json").write_text(json.dumps({**doc, "timm": "0.9.0"}))
    build_model(read_model_spec(tmp_path / "m"), 3)
    assert f"written with timm 0.9.0; timm {timm.__version__} is installed" in caplog.text


@pytest.mark.parametrize("arch, options, error, message", [
    ("timm/resnet10tt", {}, InvalidParameterError, "no model 'resnet10tt' .*closest: resnet10t"),
    (ARCH, {"zero_init_residual": True}, FamilyOptionError, "not an option of timm/resnet10t"),
])
def test_a_bad_timm_name_or_option_is_refused(tmp_path, arch, options, error, message):
    with pytest.raises(error, match=message):
        write_untrained_model(tmp_path / "m", arch, **options)
    assert not (tmp_path / "m").exists()


def test_without_timm_the_error_names_the_extra(tmp_path, monkeypatch):
    """timm made unimportable (None in sys.modules) stands in for an install without it."""
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(InvalidParameterError, match=r"pip install 'kfvision\[timm\]'"):
        write_untrained_model(tmp_path / "m", ARCH)
