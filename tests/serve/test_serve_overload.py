"""kfvision serve with more clients than it can take, and with clients that go away: real servers
on loopback ports. Beyond --max-queue a request is refused at once (REST 503 with Retry-After,
gRPC RESOURCE_EXHAUSTED) and counted on /metrics, the accepted ones get their labels; a client
that disconnects while its request is queued costs no forward pass, and no error line."""

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.request import urlopen

import grpc
import pytest
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
from kserve.protocol.grpc.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub
from prometheus_client.parser import text_string_to_metric_families

from bench.serve import bench_model
from kfvision.pipelines.serve.client import Server, request, v1_body, v2_body
from kfvision.trainer.data.imagedir import read_image_directory

NAME = "digits"
# every test here asks for a server of its own options (a `kfvision serve`, which imports torch)
pytestmark = pytest.mark.process


def samples(server) -> dict:
    """/metrics: {sample name: value} of this model's samples."""
    with urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.labels.get("model_name") == NAME}


def error_lines(server) -> list[str]:
    return [line for line in server.log.read_text(errors="replace").splitlines()
            if " ERROR " in line or "Traceback" in line or "Exception" in line]


def _grpc_request(files: list[bytes]) -> pb.ModelInferRequest:
    inp = pb.ModelInferRequest.InferInputTensor(name="image", datatype="BYTES",
                                                shape=[len(files)])
    inp.contents.bytes_contents.extend(files)
    return pb.ModelInferRequest(model_name=NAME, inputs=[inp])


# --- more clients than the queue takes -------------------------------------------------------

@pytest.fixture(scope="module")
def busy(trained_tiny, digits_640, tmp_path_factory):
    """A server that lets 2 images wait, one decode thread; 640 px JPEGs and their labels as the
    idle server gives them."""
    s = Server(["--model", trained_tiny, "--name", NAME, "--max-queue", "2",
                "--max-batch-size", "2", "--workers", "1"],
               tmp_path_factory.mktemp("overload") / "server.log")
    files = [(digits_640 / e.path).read_bytes()
             for e in read_image_directory(digits_640).images][:24]
    status, body = request(f"{s.url}/v1/models/{NAME}:predict", v1_body(files))
    assert status == 200, body
    yield s, files, [p["label"] for p in body["predictions"]]
    s.stop()


def _rest(server, path: str, body: bytes) -> tuple:
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("Retry-After"), json.loads(r.read())
    finally:
        conn.close()


def _one(server, stub, k: int, files: list, start: threading.Barrier) -> tuple:
    """Client k's request (v1, v2 or gRPC by k % 3) for image k: (protocol, label or None,
    refusal's (status, Retry-After, message) or None)."""
    i = k % len(files)
    start.wait()
    if k % 3 == 2:
        try:
            answer = stub.ModelInfer(_grpc_request([files[i]]), timeout=60)
        except grpc.RpcError as e:
            return "grpc", i, None, (e.code(), None, e.details())
        label = answer.outputs[0].contents.bytes_contents[0].decode()
        return "grpc", i, label, None
    if k % 3 == 0:
        status, retry, body = _rest(server, f"/v1/models/{NAME}:predict", v1_body([files[i]]))
        ok = status == 200 and body["predictions"][0]["label"]
    else:
        status, retry, body = _rest(server, f"/v2/models/{NAME}/infer", v2_body([files[i]]))
        ok = status == 200 and {o["name"]: o for o in body["outputs"]}["label"]["data"][0]
    return "rest", i, ok or None, None if ok else (status, retry, body.get("error"))


def test_beyond_max_queue_rest_gets_503_retry_after_and_grpc_resource_exhausted(busy):
    server, files, labels = busy
    before = samples(server)
    results, clients = [], 48
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = GRPCInferenceServiceStub(channel)
        for _ in range(6):  # rounds until both protocols have met a refusal
            start = threading.Barrier(clients)
            with ThreadPoolExecutor(clients) as pool:
                results += list(pool.map(_one, [server] * clients, [stub] * clients,
                                         range(clients), [files] * clients, [start] * clients))
            refused = {proto for proto, _, _, no in results if no}
            if refused == {"rest", "grpc"}:
                break
    accepted = [(i, label) for _, i, label, no in results if not no]
    refusals = [(proto, no) for proto, _, _, no in results if no]
    assert refused == {"rest", "grpc"} and accepted
    assert all(label == labels[i] for i, label in accepted)
    for proto, (status, retry, message) in refusals:
        assert "at capacity" in message and "at most 2" in message, message
        if proto == "rest":
            assert status == 503 and retry is not None and 1 <= int(retry) <= 60
        else:
            assert status == grpc.StatusCode.RESOURCE_EXHAUSTED
    after = samples(server)
    assert after["kfvision_refused_requests_total"] - before.get(
        "kfvision_refused_requests_total", 0) == len(refusals)
    assert after["kfvision_max_queue_images"] == 2
    assert server.alive() and error_lines(server) == []


def test_the_chosen_bound_is_printed(busy, slow):
    assert "queue: at most 2 images waiting (--max-queue;" in busy[0].log.read_text()
    # the default: measured at start-up
    line = next(line for line in slow[0].log.read_text().splitlines()
                if line.startswith("queue: "))
    assert "(0.5 s of passes, at least half of --max-batch-size; a pass of 8 images" in line
    assert samples(slow[0])["kfvision_max_queue_images"] >= 4


# --- clients that go away --------------------------------------------------------------------

@pytest.fixture(scope="module")
def slow(tmp_path_factory, digits_640):
    """ResNet-18 at 224 px (random weights), 8 images a pass: a request of 64 keeps the model
    busy for a while, so that the next one queues."""
    model = bench_model(tmp_path_factory.mktemp("r18") / "m")
    s = Server(["--model", model, "--name", NAME, "--max-batch-size", "8"],
               tmp_path_factory.mktemp("disconnect") / "server.log")
    files = [(digits_640 / e.path).read_bytes()
             for e in read_image_directory(digits_640).images]
    yield s, (files * 2)[:65]
    s.stop()


def _wait_for(server, name: str, value: float, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        now = samples(server)
        if now.get(name, 0) >= value:
            return now
        assert time.monotonic() < deadline, f"{name} did not reach {value}: {now.get(name)}"
        time.sleep(0.05)


def _rest_then_drop(server, body: bytes) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/models/{NAME}:predict HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_a_client_that_leaves_while_queued_costs_no_forward_pass(slow, transport):
    """A big request holds the model; a one-image request queues behind it and its client goes
    away: the model passes the big request's images only; no error is logged."""
    server, files = slow
    for _ in range(3):  # the big request must still be running when the client leaves
        before = samples(server)
        decoded = before.get("kfvision_decode_seconds_count", 0)
        passes = before.get("kfvision_forward_seconds_count", 0)
        with ThreadPoolExecutor(1) as pool:
            big = pool.submit(request, f"{server.url}/v1/models/{NAME}:predict",
                              v1_body(files[:64]), timeout=120)
            _wait_for(server, "kfvision_decode_seconds_count", decoded + 64)
            if transport == "rest":
                gone = _rest_then_drop(server, v1_body(files[64:65]))
            else:
                channel = grpc.insecure_channel(server.grpc_target)
                gone = GRPCInferenceServiceStub(channel).ModelInfer.future(
                    _grpc_request(files[64:65]), timeout=120)
            queued = _wait_for(server, "kfvision_decode_seconds_count", decoded + 65)
            still_running = queued["kfvision_forward_seconds_count"] - passes < 8
            if transport == "rest":
                gone.close()
            else:
                gone.cancel()
                channel.close()
            assert big.result()[0] == 200
        _wait_for(server, "kfvision_abandoned_requests_total",
                  before.get("kfvision_abandoned_requests_total", 0) + 1, timeout=10)
        if still_running:
            break
    assert still_running, "the big request ended before the other client left, 3 times"
    time.sleep(0.5)
    after = samples(server)
    assert after["kfvision_batch_images_sum"] - before.get("kfvision_batch_images_sum", 0) == 64
    assert (after["kfvision_abandoned_requests_total"]
            - before.get("kfvision_abandoned_requests_total", 0)) == 1
    assert server.alive() and error_lines(server) == []
