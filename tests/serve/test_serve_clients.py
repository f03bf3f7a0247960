"""kfvision serve spoken to by third-party Open Inference Protocol clients (tritonclient, KServe's
own), over REST in JSON and with the binary tensor extension, and over gRPC; and the hostile
requests of test_serve.py over gRPC and the binary extension. One real server for the module."""

import asyncio
import base64
import csv
import json
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.http as triton_http
from helpers.runs import jpeg_digits
from kfvision.pipelines.serve.client import request
from kfvision.pipelines.serve.kservemodel import MAX_INSTANCES
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.use.score import score
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
from kserve.protocol.grpc.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub
from test_serve import _jpeg, _png_header

NAME = "digits"


@pytest.fixture(scope="module")
def jpegs(tiny_digits, tmp_path_factory) -> dict:
    """The validation digits as 128 px JPEG files (decoded at reduced scale, as score does),
    their paths and their labels as `kfvision score` gives them."""
    return jpeg_digits(tiny_digits, tmp_path_factory.mktemp("client_jpegs"), 128)


@pytest.fixture(scope="module")
def scored(trained_tiny, jpegs, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("client_scored") / "scored.csv"
    score(trained_tiny, jpegs, out, progress=False)
    rows = list(csv.DictReader(out.open()))
    imdir = read_image_directory(jpegs)
    assert [r["image"] for r in rows] == [e.path for e in imdir.images]
    paths = [jpegs / e.path for e in imdir.images]
    return {"labels": [r["scored_label"] for r in rows], "paths": paths,
            "files": [p.read_bytes() for p in paths]}


@pytest.fixture
def server(served_digits):
    return served_digits


def _b64(files) -> list[bytes]:
    return [base64.b64encode(f) for f in files]


def _triton_http(server, files, *, binary_input: bool, binary_output: bool | None):
    """binary_output None: no outputs named (tritonclient then asks for all, binary, with the
    request parameter binary_data_output)."""
    client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    inp = triton_http.InferInput("image", [len(files)], "BYTES")
    inp.set_data_from_numpy(np.array(files, dtype=np.object_), binary_data=binary_input)
    outputs = None if binary_output is None else [
        triton_http.InferRequestedOutput(o, binary_data=binary_output)
        for o in ("label", "probabilities")]
    result = client.infer(NAME, [inp], outputs=outputs)
    assert result.as_numpy("probabilities").shape == (len(files), 10)
    # tritonclient gives BYTES outputs as bytes from binary data, as str from JSON
    return [label if isinstance(label, str) else label.decode()
            for label in result.as_numpy("label")]


def _kserve_rest(server, files, *, binary_input: bool):
    async def infer():
        inp = InferInput("image", [len(files)], "BYTES")
        inp.set_data_from_numpy(np.array(files, dtype=np.object_), binary_data=binary_input)
        client = InferenceRESTClient(RESTConfig(protocol="v2"))
        return await client.infer(server.url, InferRequest(NAME, [inp]), model_name=NAME)
    outputs = {o.name: o for o in asyncio.run(infer()).outputs}
    assert outputs["probabilities"].as_numpy().shape == (len(files), 10)
    return list(outputs["label"].data)


def _kserve_grpc(server, files):
    async def infer():
        inp = InferInput("image", [len(files)], "BYTES")
        inp.set_data_from_numpy(np.array(files, dtype=np.object_))  # raw_input_contents
        return await InferenceGRPCClient(server.grpc_target).infer(InferRequest(NAME, [inp]))
    outputs = {o.name: o for o in asyncio.run(infer()).outputs}
    assert outputs["probabilities"].as_numpy().shape == (len(files), 10)
    return [label.decode() for label in outputs["label"].as_numpy()]


# (id, labels of the image files: client, transport, form); base64 text travels as the client
# sends a string, the raw image file where the form carries bytes.
CLIENTS = [
    ("tritonclient http json base64, json outputs",
     lambda s, f: _triton_http(s, _b64(f), binary_input=False, binary_output=False)),
    ("tritonclient http json base64, binary outputs",
     lambda s, f: _triton_http(s, _b64(f), binary_input=False, binary_output=True)),
    ("tritonclient http binary raw file",
     lambda s, f: _triton_http(s, f, binary_input=True, binary_output=True)),
    ("tritonclient http binary base64",
     lambda s, f: _triton_http(s, _b64(f), binary_input=True, binary_output=False)),
    ("tritonclient http binary raw file, outputs not named",
     lambda s, f: _triton_http(s, f, binary_input=True, binary_output=None)),
    ("kserve rest json base64", lambda s, f: _kserve_rest(s, _b64(f), binary_input=False)),
    ("kserve rest binary raw file", lambda s, f: _kserve_rest(s, f, binary_input=True)),
    ("kserve grpc raw file", _kserve_grpc),
    ("kserve grpc base64", lambda s, f: _kserve_grpc(s, _b64(f))),
]


@pytest.mark.parametrize("labels_of", [c[1] for c in CLIENTS], ids=[c[0] for c in CLIENTS])
def test_every_client_gets_the_scored_labels(server, scored, labels_of):
    assert labels_of(server, scored["files"]) == scored["labels"]


def test_tritonclient_grpc_gets_the_scored_labels(server, scored):
    labels = Path(__file__).parents[1] / "helpers" / "triton_grpc_labels.py"
    out = subprocess.run([sys.executable, str(labels),
                          server.grpc_target, NAME, *map(str, scored["paths"])],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"raw": scored["labels"], "base64": scored["labels"]}


# --- hostile requests over gRPC -------------------------------------------------------------

def _grpc_bytes(elements, shape=None, datatype="BYTES", raw=False, name=NAME):
    """A ModelInferRequest with one input: elements in contents, or in raw_input_contents."""
    inp = pb.ModelInferRequest.InferInputTensor(
        name="image", datatype=datatype, shape=shape or [len(elements)])
    if raw:
        return pb.ModelInferRequest(model_name=name, inputs=[inp], raw_input_contents=[b"".join(
            struct.pack("<I", len(e)) + e for e in elements)])
    inp.contents.bytes_contents.extend(elements)
    return pb.ModelInferRequest(model_name=name, inputs=[inp])


def _raw_tensor(raw: bytes, shape):
    inp = pb.ModelInferRequest.InferInputTensor(name="image", datatype="BYTES", shape=shape)
    return pb.ModelInferRequest(model_name=NAME, inputs=[inp], raw_input_contents=[raw])


def _fp32():
    inp = pb.ModelInferRequest.InferInputTensor(name="image", datatype="FP32", shape=[1])
    inp.contents.fp32_contents.append(1.0)
    return pb.ModelInferRequest(model_name=NAME, inputs=[inp])


def _raw_and_contents():
    req = _grpc_bytes([_jpeg()])
    req.raw_input_contents.append(b"\0\0\0\0")
    return req


JPEG = _jpeg()
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
GRPC_BAD = [
    # (id, request, status, words the message names)
    ("no inputs", pb.ModelInferRequest(model_name=NAME), INVALID, "exactly one input"),
    ("empty data", _grpc_bytes([]), INVALID, "is empty"),
    ("empty raw data", _grpc_bytes([], raw=True), INVALID, "is empty"),
    ("wrong datatype", _fp32(), INVALID, "must be BYTES"),
    ("unknown datatype", _grpc_bytes([JPEG], datatype="JPEG"), INVALID, "invalid content type"),
    ("wrong shape", _grpc_bytes([JPEG], shape=[1, 1]), INVALID, "must be [1]"),
    ("shape disagrees", _grpc_bytes([JPEG], shape=[3]), INVALID, "must be [1]"),
    ("raw shape disagrees", _grpc_bytes([JPEG], shape=[3], raw=True), INVALID, "raw contents"),
    ("raw lengths broken", _raw_tensor(b"\x10\0\0\0abc", [1]), INVALID, "raw contents"),
    ("raw and contents", _raw_and_contents(), INVALID, "contents field must not be specified"),
    ("base64 broken", _grpc_bytes([b"QUJ"]), INVALID, "not valid base64"),
    ("not an image", _grpc_bytes([b"hello, world\n"]), INVALID, "not an image file"),
    ("empty image", _grpc_bytes([b""], raw=True), INVALID, "is empty"),
    ("truncated jpeg", _grpc_bytes([JPEG[:3000]], raw=True), INVALID, "cannot be decoded"),
    ("bomb", _grpc_bytes([_png_header(20_000, 20_000)]), INVALID, "decompression bomb"),
    ("too many", _grpc_bytes([_jpeg((32, 32))] * (MAX_INSTANCES + 1), raw=True), INVALID,
     f"at most {MAX_INSTANCES}"),
    ("unknown model", _grpc_bytes([JPEG], name="nope"), NOT_FOUND, "nope"),
]


@pytest.mark.parametrize("req, code, words", [b[1:] for b in GRPC_BAD],
                         ids=[b[0] for b in GRPC_BAD])
def test_bad_grpc_request_gets_invalid_argument_naming_it(server, scored, req, code, words):
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req, timeout=60)
        assert (e.value.code(), words in e.value.details()) == (code, True), e.value.details()
        assert "Traceback" not in e.value.details()
        answer = stub.ModelInfer(_grpc_bytes(scored["files"][:2], raw=True), timeout=60)
    assert server.alive() and [o.name for o in answer.outputs] == ["label", "probabilities"]


# --- hostile requests with the binary tensor extension (and JSON sent as bytes) --------------

def _binary(header: dict, data: bytes = b"", length=None) -> tuple[bytes, dict]:
    head = json.dumps(header).encode()
    return head + data, {"Inference-Header-Content-Length": str(
        len(head) if length is None else length)}


def _one(data: bytes, **spec) -> tuple[bytes, dict]:
    """One BYTES input carrying `data` (the length-prefixed elements) after the JSON header."""
    inp = {"name": "image", "datatype": "BYTES", "shape": [1],
           "parameters": {"binary_data_size": len(data)}, **spec}
    return _binary({"inputs": [inp]}, data)


def _element(e: bytes) -> bytes:
    return struct.pack("<I", len(e)) + e


def _cut(body_headers: tuple, n: int) -> tuple[bytes, dict]:
    return body_headers[0][:-n], body_headers[1]


V2 = f"/v2/models/{NAME}/infer"
BINARY_BAD = [
    # (id, (body, headers), words the error names)
    ("header not a number", _binary({"inputs": []}, length="abc"), "header is 'abc'"),
    ("header past the end", _binary({"inputs": []}, length=10_000), "at most the body"),
    ("header not json", (b"{nope", {"Inference-Header-Content-Length": "5"}), "does not parse"),
    ("no inputs", _binary({}), "'inputs' is missing"),
    ("input without shape", _binary({"inputs": [{"name": "image", "datatype": "BYTES"}]}),
     "'shape'"),
    ("input without data", _binary({"inputs": [{"name": "image", "datatype": "BYTES",
                                                "shape": [1]}]}), "neither 'data' nor"),
    ("binary_data_size past the end", _cut(_one(_element(JPEG)), 10), "binary_data_size"),
    ("element length past the end", _one(b"\xff\0\0\0ab"), "declares 255 bytes"),
    ("not an image", _one(_element(b"hello, world\n")), "not an image file"),
    ("truncated jpeg", _one(_element(JPEG[:3000])), "cannot be decoded"),
    ("bomb", _one(_element(_png_header(20_000, 20_000))), "decompression bomb"),
    ("unknown output", _binary({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                            "data": [base64.b64encode(JPEG).decode()]}],
                                "outputs": [{"name": "nope"}]}), "nope"),
    ("json as text/plain, not json", (b"hello", {"Content-Type": "text/plain"}),
     "does not parse"),
]


@pytest.mark.parametrize("body, headers, words", [(b[1][0], b[1][1], b[2]) for b in BINARY_BAD],
                         ids=[b[0] for b in BINARY_BAD])
def test_bad_binary_request_gets_a_4xx_naming_it(server, scored, body, headers, words):
    headers = {"Content-Type": "application/octet-stream", **headers}
    status, answer = request(server.url + V2, body, headers["Content-Type"], headers=headers)
    assert 400 <= status < 500, (status, answer)
    assert words in answer["error"] and "Traceback" not in answer["error"], answer
    assert server.alive()
    assert _kserve_rest(server, scored["files"][:2], binary_input=True) == scored["labels"][:2]


# --- /metrics -------------------------------------------------------------------------------

def test_metrics_count_decodes_forward_passes_and_batch_images(server, scored):
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict:
        with urlopen(server.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        return {(s.name, s.labels.get("model_name")): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    before = samples()
    assert _kserve_grpc(server, scored["files"][:5]) == scored["labels"][:5]
    after = samples()

    def added(name):
        return after[(name, NAME)] - before.get((name, NAME), 0)
    assert added("kfvision_decode_seconds_count") == 5
    assert added("kfvision_batch_images_sum") == 5 and added("kfvision_forward_seconds_count") >= 1
    assert added("kfvision_forward_seconds_sum") > 0
    assert added("request_predict_seconds_count") == 1  # KServe's own, beside ours


def test_metrics_name_the_cpu_and_the_speed_choices_taken_for_it(server):
    from urllib.request import urlopen

    from kfvision.trainer.fastpath import cpu_features
    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    info = next(s.labels for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "kfvision_fast_path_info" and s.labels.get("model_name") == NAME)
    cpu = cpu_features()  # the server runs in this environment, ONEDNN_MAX_CPU_ISA included
    assert (info["runtime"], info["cpu_kind"], info["cpu_model"]) == ("torch", cpu.kind,
                                                                      cpu.model)
    assert info["vnni"] == str(cpu.vnni).lower() and info["graph"].startswith("batch norms")
