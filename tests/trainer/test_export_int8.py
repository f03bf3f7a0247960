"""kfvision export --quantize int8: the trained digits model quantized for real (onnxruntime's
calibration on its training digits), checked on the validation digits, served by OpenVINO
through Predictor and `kfvision serve`."""

import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from helpers.machine import fake_cpu

from kfvision.pipelines.cli import main
from kfvision.pipelines.serve.client import Server, request, v1_body, v2_body
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.errors import (
    ExportNotSupportedError,
    Int8CpuMismatchError,
    QuantizationError,
)
from kfvision.trainer.fastpath import cpu_features, int8_reduce_range
from kfvision.trainer.use import quantize
from kfvision.trainer.use.predict import Predictor, onnx_metadata

MILAN = ("AMD EPYC 7763 64-Core Processor", {"avx", "avx2", "fma"})  # no AVX-512, no VNNI
ZEN4 = ("AMD EPYC 9R14", {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"})


@pytest.fixture(scope="module")
def int8(trained_tiny, tiny_digits, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8") / "digits-int8.onnx"
    rc = main(["export", "--model", str(trained_tiny), "--format", "onnx", "--quantize", "int8",
               "--calibrate", str(tiny_digits["train"]), "--check", str(tiny_digits["val"]),
               "--calibration-images", "100", "--out", str(out)])
    assert rc == 0
    return out


def _val(data_dir) -> tuple[list[bytes], list[str]]:
    imdir = read_image_directory(data_dir)
    return ([(data_dir / e.path).read_bytes() for e in imdir.images],
            [imdir.classes[e.label] for e in imdir.images])


def test_the_export_carries_its_accuracy_figures(int8, tiny_digits):
    meta = onnx_metadata(int8)
    q = meta["quantization"]
    assert (q["dtype"], q["runtime"], q["calibration_images"]) == ("int8", "openvino", 100)
    assert q["val_images"] == len(read_image_directory(tiny_digits["val"]).images)
    assert q["top1_int8"] >= q["top1_fp32"] - quantize.MAX_TOP1_DROP
    assert meta["input"]["dtype"] == "uint8" and meta["classes"] == [str(i) for i in range(10)]
    assert [p.name for p in int8.parent.iterdir()] == [int8.name]  # no temporary files left


def _largest_weight(path) -> int:
    """The largest |int8 weight| of the QDQ file's convolutions and matrix multiplies."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(path))
    weights = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer
               if t.data_type == onnx.TensorProto.INT8}
    dq = [n.input[0] for n in proto.graph.node if n.op_type == "DequantizeLinear"]
    return max(int(np.abs(weights[name].astype(np.int32)).max()) for name in dq
               if name in weights)


def test_the_export_quantizes_for_the_cpu_it_runs_on(int8):
    """7-bit weights where this process's int8 kernels lack VNNI (a real AVX2 CPU, or this one
    under ONEDNN_MAX_CPU_ISA=AVX2), full 8-bit ones with VNNI; the choice and the CPU recorded."""
    q = onnx_metadata(int8)["quantization"]
    assert q["reduce_range"] is int8_reduce_range() and q["cpu"] == cpu_features().to_dict()
    # per-channel symmetric: every channel's largest weight is the range's end, 64 or 127
    assert _largest_weight(int8) == (64 if q["reduce_range"] else 127)


@pytest.mark.slow
def test_an_export_on_a_cpu_without_vnni_has_7_bit_weights(trained_tiny, tiny_digits, tmp_path,
                                                           monkeypatch):
    fake_cpu(monkeypatch, MILAN[1], MILAN[0])
    out = tmp_path / "milan.onnx"
    meta = quantize.export_int8(trained_tiny, out, tiny_digits["train"], tiny_digits["val"],
                                calibration=20, progress=False)
    q = meta["quantization"]
    assert q["reduce_range"] is True and onnx_metadata(out)["quantization"] == q
    assert (q["cpu"]["model"], q["cpu"]["kind"], q["cpu"]["vnni"]) == (MILAN[0], "AVX2 only",
                                                                       False)
    assert _largest_weight(out) == 64
    assert Predictor(out, threads=1).runtime == "openvino"  # served there


def _with_choice(int8, tmp_path, reduce_range) -> object:
    """A copy of the int8 export whose metadata says it was quantized with `reduce_range`
    (None: an export from before the choice was recorded) on a Zen 4 EPYC."""
    path = tmp_path / f"rr-{reduce_range}.onnx"
    shutil.copy(int8, path)
    meta = onnx_metadata(path)
    q = meta["quantization"]
    q.pop("reduce_range")
    q["cpu"] = {"model": ZEN4[0], "kind": "AVX512_BF16", "vnni": True}
    if reduce_range is not None:
        q["reduce_range"] = reduce_range
    quantize._set_metadata(path, meta)
    return path


@pytest.mark.parametrize("reduce_range, cpu, refused", [
    (False, MILAN, True),
    (None, MILAN, True),  # exported before the choice was recorded: 8-bit weights
    (True, MILAN, False),
    (False, ZEN4, False),
    (True, ZEN4, False),
])
def test_predictor_refuses_8_bit_weights_on_a_cpu_without_vnni(int8, tmp_path, monkeypatch,
                                                              reduce_range, cpu, refused):
    path = _with_choice(int8, tmp_path, reduce_range)
    fake_cpu(monkeypatch, cpu[1], cpu[0])
    if not refused:
        assert Predictor(path, threads=1).fast_path()["cpu_kind"] == cpu_features().kind
        return
    with pytest.raises(Int8CpuMismatchError) as e:
        Predictor(path, threads=1)
    message = str(e.value)
    assert str(path) in message and ZEN4[0] in message and MILAN[0] in message
    assert "no VNNI" in message and "Re-export on this machine" in message


def test_predictor_serves_it_on_openvino_close_to_fp32(int8, trained_tiny_onnx, tiny_digits):
    files, labels = _val(tiny_digits["val"])
    fp32, q8 = Predictor(trained_tiny_onnx[0], threads=1), Predictor(int8, threads=1)
    assert (fp32.runtime, q8.runtime) == ("onnx", "openvino")
    assert q8.describe()["runtime"] == "openvino" and q8.classes == fp32.classes
    batch = torch.stack([q8.preprocess(f) for f in files])
    a, b = fp32.probabilities(batch), q8.probabilities(batch)
    assert b.dtype == np.float32 and b.shape == a.shape
    assert (a.argmax(1) == b.argmax(1)).mean() >= 0.95
    assert np.abs(a - b).max() < 0.15
    # the accuracy export measured is the one Predictor serves
    top1 = float(np.mean([q8.classes[i] == y for i, y in zip(b.argmax(1), labels)]))
    assert top1 == pytest.approx(onnx_metadata(int8)["quantization"]["top1_int8"])
    hints = q8.fast_path()
    assert (hints["runtime"], hints["precision_hint"]) == ("openvino", "f32")
    assert hints["int8_weights"] == ("7-bit" if int8_reduce_range() else "8-bit")


def test_concurrent_callers_each_get_their_own_answers(int8, tiny_digits):
    files, _ = _val(tiny_digits["val"])
    p = Predictor(int8, threads=1)
    batches = [torch.stack([p.preprocess(f) for f in files[i:i + n]])
               for i, n in zip(range(0, 48, 8), [1, 8, 3, 8, 5, 2])]
    alone = [p.probabilities(b) for b in batches]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            together = list(pool.map(p.probabilities, batches))
            assert all(np.array_equal(x, y) for x, y in zip(alone, together))


@pytest.mark.slow
def test_a_model_that_loses_accuracy_is_refused_and_not_written(trained_tiny, tiny_digits,
                                                                tmp_path, monkeypatch):
    """Forced honestly: the threshold is set so that int8 would have to beat fp32 by 100 points,
    which no model can; the figures in the message are the real ones of this calibration."""
    monkeypatch.setattr(quantize, "MAX_TOP1_DROP", -1.0)
    out = tmp_path / "refused.onnx"
    with pytest.raises(QuantizationError) as e:
        quantize.export_int8(trained_tiny, out, tiny_digits["train"], tiny_digits["val"],
                             calibration=20, progress=False)
    message = str(e.value)
    assert message.count("%") >= 2 and "in fp32" in message and "int8" in message
    assert "not written" in message and "--calibration-images" in message
    assert "(resnet18)" in message  # the architecture, as the exporters' errors name it
    assert list(tmp_path.iterdir()) == []


def test_a_quantizer_failure_names_the_architecture(tmp_path):
    """A real onnxruntime failure (its quantizer given a file that is no ONNX model) comes out
    as ExportNotSupportedError naming the architecture, the cause kept."""
    bad = tmp_path / "fp32.onnx"
    bad.write_bytes(b"not an onnx model")
    images = np.zeros((1, 3, 32, 32), np.float32)
    with pytest.raises(ExportNotSupportedError) as e, quantize._int8_errors("convnext_tiny"):
        quantize.quantize_onnx(bad, tmp_path / "int8.onnx", images, progress=False)
    assert "convnext_tiny cannot be quantized to int8" in str(e.value)
    assert "--quantize none" in str(e.value) and e.value.__cause__ is not None


@pytest.mark.parametrize("flags, missing", [
    (["--calibrate", "X"], "--check"),
    (["--check", "X"], "--calibrate"),
    (["--calibrate", "X", "--check", "X", "--format", "torchscript"], "--format onnx"),
])
def test_int8_needs_calibration_and_check_data(flags, missing, tmp_path, capsys):
    rc = main(["export", "--model", str(tmp_path), "--quantize", "int8", "--out",
               str(tmp_path / "m.onnx"), *flags])
    assert rc == 2
    assert f"missing: {missing}" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


def _grpc_labels(target: str, files: list[bytes]) -> list[str]:
    import grpc
    from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
    from kserve.protocol.grpc.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub

    image = pb.ModelInferRequest.InferInputTensor(name="image", datatype="BYTES",
                                                  shape=[len(files)])
    image.contents.bytes_contents.extend(files)
    with grpc.insecure_channel(target) as channel:
        answer = GRPCInferenceServiceStub(channel).ModelInfer(
            pb.ModelInferRequest(model_name="digits", inputs=[image]), timeout=60)
    label = next(o for o in answer.outputs if o.name == "label")
    return [b.decode() for b in label.contents.bytes_contents]


@pytest.mark.slow
def test_kfvision_serve_answers_v1_v2_and_grpc_with_predictor_labels(int8, tiny_digits,
                                                                     tmp_path):
    files, _ = _val(tiny_digits["val"])
    files = files[:16]
    expected = Predictor(int8, threads=1)
    batch = torch.stack([expected.preprocess(f) for f in files])
    labels = [expected.classes[i] for i in expected.probabilities(batch).argmax(1)]
    server = Server(["--model", int8, "--name", "digits", "--max-batch-size", "8"],
                    tmp_path / "server.log")
    try:
        assert "(openvino, 10 classes)" in server.logs()  # before requests push it out of logs()
        status, v1 = request(f"{server.url}/v1/models/digits:predict", v1_body(files))
        assert status == 200, v1
        assert [p["label"] for p in v1["predictions"]] == labels
        status, v2 = request(f"{server.url}/v2/models/digits/infer", v2_body(files))
        assert status == 200, v2
        assert next(o for o in v2["outputs"] if o["name"] == "label")["data"] == labels
        assert _grpc_labels(server.grpc_target, files) == labels
    finally:
        server.stop()


def test_export_flags_agree_with_the_quantize_module():
    from kfvision.pipelines.cli import build_parser

    export = build_parser(["export"])._subparsers._group_actions[0].choices["export"]
    flags = {a.dest: a for a in export._actions}
    assert tuple(flags["quantize"].choices) == quantize.QUANTIZE
    assert flags["calibration_images"].default == quantize.CALIBRATION_IMAGES


def test_serve_offers_every_predictor_runtime():
    from kfvision.pipelines.cli import build_parser
    from kfvision.pipelines.serve.server import ServeOptions
    from kfvision.trainer.options import options_of
    from kfvision.trainer.use.predict import RUNTIMES

    declared = next(o for o in options_of(ServeOptions) if o.name == "runtime")
    assert tuple(declared.choices) == RUNTIMES
    serve = build_parser(["serve"])._subparsers._group_actions[0].choices["serve"]
    flag = next(a for a in serve._actions if a.dest == "runtime")
    assert flag.metavar == "{" + ",".join(RUNTIMES) + "}"  # what --help shows
