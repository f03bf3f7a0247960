"""`--runtime auto`: PyTorch or OpenVINO fp32 for a trained model directory, by a probe cached per
machine and model (trainer/use/autoruntime.py), recorded on the start-up line, /metrics and
describe(). Which runtime the probe picks on this machine depends on its load, so the tests that
need a given outcome plant the probe's record in the cache; the probe itself runs for real."""

import json

import pytest
import torch

from tests.conftest import fake_cpu
from trainer.fastpath import cpu_features
from trainer.use import autoruntime
from trainer.use.ovruntime import openvino_version
from trainer.use.predict import Predictor

MILAN = ("AMD EPYC 7763 64-Core Processor", {"avx2", "fma", "sse4_2"})
GENOA = ("AMD EPYC 9R14", {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"})
TOLERANCE = 1e-4  # fp32 against fp32: largest |difference| of a softmax probability


@pytest.fixture(scope="module")
def digits_batch(trained_tiny, tiny_digits) -> torch.Tensor:
    """The validation digits as the server hands them to the model (uint8, decoded as served)."""
    from trainer.data.imagedir import read_image_directory

    p = Predictor(trained_tiny, "torch", threads=1)
    imdir = read_image_directory(tiny_digits["val"])
    return torch.stack([p.preprocess((tiny_digits["val"] / e.path).read_bytes())
                        for e in imdir.images])


def _plant(cache, model, speedup: float, threads: int = 1, batch: int = 8) -> None:
    """A probe record for this machine that measured OpenVINO `speedup` times PyTorch."""
    digest = autoruntime.model_hash(model)
    batches = autoruntime.probe_batches(batch)
    key = autoruntime.probe_key(digest, cpu_features(), threads, batches, openvino_version())
    autoruntime.write_probe(cache, key, {"probe": autoruntime.PROBE_VERSION, "seconds": 0.5,
                                         "ratios": {b: speedup for b in batches}})


def test_openvino_fp32_gives_torch_fp32_probabilities_on_the_digits(trained_tiny, digits_batch,
                                                                    tmp_path):
    fp32 = Predictor(trained_tiny, "torch", threads=1)
    ov = Predictor(trained_tiny, "openvino", threads=1, cache=tmp_path)
    assert (fp32.runtime, ov.runtime) == ("torch", "openvino")
    assert ov.classes == fp32.classes and ov.image_size == fp32.image_size
    a, b = fp32.probabilities(digits_batch), ov.probabilities(digits_batch)
    assert abs(a - b).max() < TOLERANCE
    assert (a.argmax(1) == b.argmax(1)).all()
    assert list((tmp_path / "ir").iterdir())  # converted once, kept for the next start


@pytest.mark.parametrize("speedup, runtime", [(3.0, "openvino"), (2.0, "openvino"),
                                              (1.9, "torch"), (0.4, "torch")])
def test_auto_takes_the_cached_probe_of_this_machine(trained_tiny, tmp_path, speedup, runtime):
    _plant(tmp_path, trained_tiny, speedup)
    p = Predictor(trained_tiny, "auto", threads=1, cache=tmp_path)
    assert p.runtime == runtime and "cached probe" in p.choice
    assert p.describe()["runtime_choice"] == p.choice == p.fast_path()["runtime_choice"]
    assert f"{speedup:.2f}x" in p.choice and cpu_features().kind in p.choice
    # a cached "torch" converts nothing: a restart costs what it cost before
    assert (tmp_path / "ir").is_dir() == (runtime == "openvino")


@pytest.mark.parametrize("ratios, expected", [
    ({1: 3.2, 8: 1.6}, "openvino"),  # geometric mean 2.26
    ({1: 2.5, 8: 2.5}, "openvino"),
    ({1: 4.0, 8: 0.9}, "torch"),  # 1.90: within the margin
    ({1: 1.39, 8: 1.39}, "torch"),  # what served 0.43-0.62x of PyTorch's images/s here
])
def test_the_decision_is_the_geometric_mean_against_the_margin(ratios, expected):
    choice = autoruntime.decide(ratios, "AVX2 only", 1.0, cached=False)
    assert choice.runtime == expected and "AVX2 only" in choice.reason
    assert "probed in 1.0 s" in choice.reason


def test_the_probe_runs_once_per_cpu_and_is_reused(trained_tiny, tmp_path, monkeypatch):
    fake_cpu(monkeypatch, MILAN[1], MILAN[0])
    first = Predictor(trained_tiny, "auto", threads=1, cache=tmp_path)
    assert "probed in" in first.choice and "AVX2 only" in first.choice
    records = list((tmp_path / "probe").glob("*.json"))
    assert len(records) == 1
    record = json.loads(records[0].read_text())
    assert record["cpu"]["kind"] == "AVX2 only" and set(record["ratios"]) == {"1", "8"}
    again = Predictor(trained_tiny, "auto", threads=1, cache=tmp_path)
    assert again.runtime == first.runtime and "cached probe" in again.choice
    fake_cpu(monkeypatch, GENOA[1], GENOA[0])  # another machine: its own probe
    other = Predictor(trained_tiny, "auto", threads=1, cache=tmp_path)
    assert "probed in" in other.choice and "AVX512_BF16" in other.choice
    assert len(list((tmp_path / "probe").glob("*.json"))) == 2


def test_openvino_on_a_model_directory_refuses_cuda(trained_tiny):
    from trainer.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="runs on the CPU"):
        Predictor(trained_tiny, "openvino", device="cuda")


def test_auto_leaves_every_other_model_to_its_runtime(trained_tiny_onnx, tmp_path):
    p = Predictor(trained_tiny_onnx[0], "auto", threads=1, cache=tmp_path)
    assert p.runtime == "onnx" and p.choice == "auto: by the model"
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing probed


def test_the_converted_networks_kept_are_bounded(tmp_path):
    ir = tmp_path / "ir"
    for i in range(autoruntime.IR_KEPT + 2):
        (ir / f"model{i}").mkdir(parents=True)
    autoruntime.prune(ir)
    assert len(list(ir.iterdir())) == autoruntime.IR_KEPT


def _fast_path_info(name: str) -> dict:
    """kfvision_fast_path_info's labels for `name`, as `/metrics` writes them out
    (prometheus_client's default registry, the one KServe's endpoint serves)."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(REGISTRY).decode()
    return next(s.labels for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "kfvision_fast_path_info" and s.labels.get("model_name") == name)


@pytest.mark.parametrize("runtime, planted, expected, reason", [
    (None, 5.0, "torch", "by the model"),  # the default: no probe, whatever a probe said
    ("torch", 5.0, "torch", "--runtime torch"),
    ("auto", 5.0, "openvino", "auto: OpenVINO fp32 5.00x"),
    ("auto", 0.5, "torch", "auto: OpenVINO fp32 only 0.50x"),
])
def test_serve_reports_its_runtime_and_why_on_metrics(trained_tiny, tmp_path, monkeypatch,
                                                      capsys, runtime, planted, expected,
                                                      reason):
    from pipelines.serve.server import build_model
    from trainer.distributed import usable_cpus

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _plant(tmp_path / "kfvision" / "runtime", trained_tiny, planted, threads=usable_cpus(),
           batch=8)
    name = f"rt-{runtime}-{expected}"
    classifier = build_model(trained_tiny, name=name, runtime=runtime, max_batch_size=8)
    try:
        info = _fast_path_info(name)
        assert info["runtime"] == classifier.predictor.runtime == expected
        assert info["runtime_choice"].startswith(reason)
        assert f"runtime: {expected} ({info['runtime_choice']})" in capsys.readouterr().out
    finally:
        classifier.stop()
