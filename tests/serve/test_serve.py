"""kfvision serve: a real server process on a loopback port, spoken to over HTTP (v1 and v2)."""

import base64
import csv
import io
import json
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from kfvision.pipelines.serve.client import request, v1_body, v2_body
from kfvision.pipelines.serve.kservemodel import MAX_INSTANCES
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.use.score import score
from PIL import Image


@pytest.fixture
def server(served_digits):
    return served_digits


def _files(data_dir) -> tuple[list[str], list[bytes]]:
    imdir = read_image_directory(data_dir)
    return ([e.path for e in imdir.images],
            [(data_dir / e.path).read_bytes() for e in imdir.images])


def _v1_labels(server, files):
    status, body = request(f"{server.url}/v1/models/digits:predict", v1_body(files))
    assert status == 200, body
    return [p["label"] for p in body["predictions"]], body


def _v2_labels(server, files):
    status, body = request(f"{server.url}/v2/models/digits/infer", v2_body(files))
    assert status == 200, body
    out = {o["name"]: o for o in body["outputs"]}
    assert out["probabilities"]["shape"] == [len(files), 10]
    return out["label"]["data"], body


@pytest.mark.parametrize("data", ["val", "digits_640"])
def test_served_labels_equal_scored_labels_v1_and_v2(server, trained_tiny, tiny_digits,
                                                     digits_640, data, tmp_path):
    data_dir = tiny_digits["val"] if data == "val" else digits_640
    score(trained_tiny, data_dir, tmp_path / "scored.csv", progress=False)
    rows = list(csv.DictReader((tmp_path / "scored.csv").open()))
    paths, files = _files(data_dir)
    assert [r["image"] for r in rows] == paths
    scored = [r["scored_label"] for r in rows]
    for chunk in range(0, len(files), 16):
        part = files[chunk:chunk + 16]
        v1, body = _v1_labels(server, part)
        v2, _ = _v2_labels(server, part)
        assert v1 == v2 == scored[chunk:chunk + 16]
        for pred, row in zip(body["predictions"], rows[chunk:chunk + 16]):
            for c, p in pred["probabilities"].items():
                assert p == pytest.approx(float(row[f"scored_probability_{c}"]), abs=1e-5)


@pytest.mark.parametrize("path, expected", [
    ("/v2/health/live", {"live": True}),
    ("/v2/health/ready", {"ready": True}),
    ("/v2/models/digits/ready", {"name": "digits", "ready": True}),
    ("/v1/models/digits", {"name": "digits", "ready": True}),
    ("/v2/models/digits", {"name": "digits",
                           "inputs": [{"name": "image", "datatype": "BYTES", "shape": [-1]}],
                           "outputs": [{"name": "label", "datatype": "BYTES", "shape": [-1]},
                                       {"name": "probabilities", "datatype": "FP32",
                                        "shape": [-1, 10]}]}),
    ("/v1/models", {"models": ["digits"]}),
])
def test_health_and_metadata(server, path, expected):
    status, body = request(server.url + path)
    assert status == 200
    assert {k: body[k] for k in expected} == expected


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height pixels (one empty row of data): a bomb's header."""
    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0,
                                                              0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b""))


def _jpeg(size=(640, 480)) -> bytes:
    buf = io.BytesIO()
    Image.linear_gradient("L").convert("RGB").resize(size).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _v1_raw(b64) -> bytes:
    return json.dumps({"instances": [{"image": {"b64": b64}}]}).encode()


def _v2(datatype="BYTES", shape=None, data=None, inputs=None) -> bytes:
    data = data if data is not None else [base64.b64encode(_jpeg()).decode()]
    one = {"name": "image", "datatype": datatype, "shape": shape or [len(data)], "data": data}
    return json.dumps({"inputs": inputs if inputs is not None else [one]}).encode()


V1, V2 = "/v1/models/digits:predict", "/v2/models/digits/infer"
TOO_MANY = [_jpeg((32, 32))] * (MAX_INSTANCES + 1)
BAD_REQUESTS = [
    # (id, path, body, content type, words the error names)
    ("v1 not json", V1, b"{not json", "application/json", "Unrecognized request format"),
    ("v1 not json text", V1, b"hello", "text/plain", "JSON object"),
    ("v1 no instances", V1, b"{}", "application/json", "'instances' is missing"),
    ("v1 empty instances", V1, b'{"instances": []}', "application/json", "is empty"),
    ("v1 instance not an image", V1, b'{"instances": [{"b64": "AA=="}]}', "application/json",
     "instances[0] must be"),
    ("v1 not base64", V1, _v1_raw("@@not base64@@"), "application/json", "not valid base64"),
    ("v1 b64 not a string", V1, _v1_raw(12), "application/json", "base64 string"),
    ("v1 not an image", V1, _v1_raw(base64.b64encode(b"hello").decode()), "application/json",
     "not an image file"),
    ("v1 empty image", V1, _v1_raw(""), "application/json", "is empty"),
    ("v1 truncated jpeg", V1, _v1_raw(base64.b64encode(_jpeg()[:3000]).decode()),
     "application/json", "cannot be decoded"),
    ("v1 bomb", V1, _v1_raw(base64.b64encode(_png_header(10_000, 10_000)).decode()),
     "application/json", "decompression bomb"),
    ("v1 huge bomb", V1, _v1_raw(base64.b64encode(_png_header(20_000, 20_000)).decode()),
     "application/json", "decompression bomb"),
    ("v1 too many", V1, v1_body(TOO_MANY), "application/json", f"at most {MAX_INSTANCES}"),
    ("v1 unknown model", "/v1/models/nope:predict", v1_body([_jpeg()]), "application/json",
     "nope"),
    ("v2 not json", V2, b"{not json", "application/json", "not a v2 inference request"),
    ("v2 no inputs", V2, b"{}", "application/json", "inputs"),
    ("v2 empty inputs", V2, _v2(inputs=[]), "application/json", "exactly one input"),
    ("v2 empty data", V2, _v2(data=[], shape=[0]), "application/json", "is empty"),
    ("v2 wrong datatype", V2, _v2(datatype="FP32", data=[1.0]), "application/json",
     "must be BYTES"),
    ("v2 wrong shape", V2, _v2(shape=[1, 1]), "application/json", "must be [1]"),
    ("v2 shape disagrees", V2, _v2(shape=[3]), "application/json", "must be [1]"),
    ("v2 nested data", V2, _v2(shape=[1, 1], data=[["x"]]), "application/json", "flat list"),
    ("v2 not base64", V2, _v2(data=["@@"]), "application/json", "not valid base64"),
    ("v2 truncated", V2, _v2(data=[base64.b64encode(_jpeg()[:3000]).decode()]),
     "application/json", "cannot be decoded"),
    ("v2 too many", V2, v2_body(TOO_MANY), "application/json", f"at most {MAX_INSTANCES}"),
    ("v2 unknown model", "/v2/models/nope/infer", _v2(), "application/json", "nope"),
]


@pytest.mark.parametrize("path, body, content_type, words", [b[1:] for b in BAD_REQUESTS],
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_a_4xx_naming_it_and_the_server_keeps_serving(
        server, tiny_digits, path, body, content_type, words):
    status, answer = request(server.url + path, body, content_type)
    assert 400 <= status < 500, (status, answer)
    assert words in answer["error"], answer
    assert "Traceback" not in answer["error"]
    assert server.alive()
    _, files = _files(tiny_digits["val"])
    assert len(_v1_labels(server, files[:2])[0]) == 2


def test_concurrent_requests_each_get_their_own_answers(server, tiny_digits):
    _, files = _files(tiny_digits["val"])
    alone = [_v1_labels(server, [f])[0][0] for f in files[:24]]
    sizes = [1, 2, 3, 1, 5, 1, 2, 9]  # more than --max-batch-size 8 in one request too
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    with ThreadPoolExecutor(len(sizes)) as pool:
        got = list(pool.map(lambda s: _v1_labels(server, files[s[0]:s[0] + s[1]])[0],
                            zip(starts, sizes)))
    assert [label for labels in got for label in labels] == alone


@pytest.mark.slow
def test_the_onnx_runtime_gives_the_torch_runtime_labels(trained_tiny, trained_tiny_onnx,
                                                        digits_640):
    from kfvision.trainer.use.predict import Predictor

    torch_rt, onnx_rt = Predictor(trained_tiny), Predictor(trained_tiny_onnx[0], threads=1)
    assert (torch_rt.runtime, onnx_rt.runtime) == ("torch", "onnx")
    assert onnx_rt.classes == torch_rt.classes and onnx_rt.image_size == torch_rt.image_size
    _, files = _files(digits_640)
    batch = torch.stack([torch_rt.preprocess(f) for f in files])
    assert torch.equal(batch, torch.stack([onnx_rt.preprocess(f) for f in files]))
    a, b = torch_rt.probabilities(batch), onnx_rt.probabilities(batch)
    assert (a.argmax(1) == b.argmax(1)).all() and abs(a - b).max() < 1e-4
