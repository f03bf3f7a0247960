"""`kfvision serve`: a trained model behind KServe's model server: REST (v1 and v2 protocols)
and the v2 protocol over gRPC.

One process holds the model, loaded once; requests are decoded on `decode_threads` threads and
batched into forward passes (pipelines/serve/batcher.py). Scale out with replicas (an
InferenceService's min/max replicas), not with processes on one machine.
"""

import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kfvision.trainer.options import check_options, option

# kfvision.trainer.use.predict.RUNTIMES, written out: importing it would load torch for `kfvision
# --help`
RUNTIMES = ("torch", "onnx", "openvino")
# The queueing delay the default --max-queue allows an accepted request: images for this long
# of forward passes wait at most (at least half a batch)
QUEUE_DELAY_S = 0.5


@dataclass(frozen=True)
class ServeOptions:
    """`kfvision serve`'s options, declared once: its flags, the checks of `build_model` and
    `serve`, and docs/serving.md's table come from these fields."""

    model: str = option(help="trained model directory, or an ONNX file", doc="An ONNX file as "
                        "`kfvision export` writes it (int8 too). Either may be an s3:// URI "
                        "(fetched once into a cache keyed by its ETags); or models:/NAME/VERSION "
                        "or models:/NAME@ALIAS (MLflow's registry).")
    name: str | None = option(None, "model name in the URLs", unset="from the model's path")
    # KServe's defaults (kserve 0.21 kserve/constants/constants.py DEFAULT_HTTP_PORT,
    # DEFAULT_GRPC_PORT), which an InferenceService's predictor container is expected to serve on
    http_port: int = option(8080, "REST port, all interfaces", low=1, high=65535,
                            doc="KServe's default.")
    grpc_port: int = option(8081, "v2 gRPC port, all interfaces", low=1, high=65535,
                            doc="KServe's default.")
    workers: int | None = option(None, "threads that decode images", low=1, high=256,
                                 unset="the number of CPUs", doc="One process holds the model, "
                                 "loaded once.")
    model_threads: int | None = option(None, "threads of one forward pass", low=1, high=256,
                                       unset="the number of CPUs")
    model_streams: int | None = option(None, "forward passes that may run at once", low=1,
                                       high=256, unset="1", doc="Each on --model-threads "
                                       "threads, e.g. 4 streams x 4 threads on 16 cores.")
    device: str = option("cpu", "where the model runs", choices=("cpu", "cuda"),
                         doc="cuda: on the GPU (PyTorch runtime).")
    runtime: str | None = option(None, "what runs the model", choices=RUNTIMES,
                                 unset="by --model", doc="torch for a model directory (onnx "
                                 "for a script's with model.onnx), onnx for an ONNX file, "
                                 "openvino for an int8 one (`kfvision export --quantize int8`).")
    max_batch_size: int = option(32, "images per forward pass at most", low=1, high=1024,
                                 doc="Across concurrent requests.")
    batch_wait_ms: float = option(5.0, "how long an idle model waits for requests still "
                                  "decoding", low=0, high=1000, doc="Then it runs the batch it "
                                  "has; a lone client never waits for it.")
    max_queue: int | None = option(None, "images waiting for the model at most (0: no bound)",
                                   low=0, high=1_000_000, unset="0.5 s of passes, measured",
                                   doc="Images being decoded or queued, not those in a running "
                                   "pass; by default what a pass measured at start-up says the "
                                   "model answers in 0.5 s, at least half of --max-batch-size. "
                                   "Beyond it a request is refused at once: REST 503 with "
                                   "Retry-After, gRPC RESOURCE_EXHAUSTED (docs/faults.md). A "
                                   "request finding the queue empty is always taken.")


def default_name(model) -> str:
    """A model name for the URLs from the model's path: lower case, [a-z0-9-]."""
    stem = Path(model).stem if Path(model).is_file() else Path(model).name
    return re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-") or "model"


def _import_kserve():
    """kserve.ModelServer parses sys.argv when imported (flags like --workers and --http_port);
    import it with an empty command line so kfvision's flags are ours alone."""
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        from kserve import ModelServer
    finally:
        sys.argv = argv
    return ModelServer


def measured_rate(predictor, max_batch: int, streams: int) -> tuple[float, int]:
    """(images/s of the model, images in the measured pass): one pass of up to max_batch blank
    images after a warm-up pass (whose allocations and first-call work a server pays once)."""
    import torch

    n = min(max_batch, 32)
    batch = torch.zeros(n, 3, predictor.image_size, predictor.image_size, dtype=torch.uint8)
    predictor.probabilities(batch)
    start = time.perf_counter()
    predictor.probabilities(batch)
    return n * streams / max(time.perf_counter() - start, 1e-6), n


def default_max_queue(rate: float, max_batch: int) -> int:
    """Images the model answers in QUEUE_DELAY_S at `rate` images/s, at least half a batch.

    A pass takes only what waited, so with one-image requests the server then holds at most twice
    the bound: on a slow model, at most a full batch, whose passes cost about what a full one
    does per image; more waiting would only lengthen the wait (Little's law)."""
    return max(max(1, max_batch // 2), math.ceil(rate * QUEUE_DELAY_S))


async def _invalid_request(request, exc):
    """FastAPI's body validation (v2 requests) as the other errors look: 400 {"error": ...}."""
    from fastapi.responses import ORJSONResponse

    problems = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}"
                         for e in exc.errors()[:4])
    return ORJSONResponse(status_code=400, content={
        "error": f"the request body is not a v2 inference request ({problems})"})


def _refused(exc):
    """A refusal (`Overloaded`): 503 with Retry-After, not logged (one line per refused request
    would flood the log when the server is busiest)."""
    from fastapi.responses import ORJSONResponse

    return ORJSONResponse(status_code=503, content={"error": exc.details},
                          headers={"Retry-After": str(exc.retry_after)})


async def _overloaded(request, exc):
    return _refused(exc)


def build_model(model, *, name: str | None = None, runtime: str | None = None,
                device: str = "cpu", workers: int | None = None,
                model_threads: int | None = None, model_streams: int | None = None,
                max_batch_size: int = ServeOptions.max_batch_size,
                batch_wait_ms: float = ServeOptions.batch_wait_ms,
                max_queue: int | None = None):
    """The loaded `ImageClassifier` for a trained model directory or an ONNX export."""
    _import_kserve()
    from kfvision.pipelines.serve.batcher import Batcher
    from kfvision.pipelines.serve.kservemodel import ImageClassifier
    from kfvision.pipelines.serve.metrics import FAST_PATH, MAX_QUEUE, timed_forward
    from kfvision.trainer.cpus import usable_cpus
    from kfvision.trainer.use.predict import Predictor

    check_options(ServeOptions(
        str(model), name=name, runtime=runtime, device=device, workers=workers,
        model_threads=model_threads, model_streams=model_streams,
        max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms, max_queue=max_queue))
    cpus = usable_cpus()  # a container's CPU limit, not the node's cores
    workers = min(workers or cpus, 256)
    # One forward pass at a time on all the cores, by default: batches then grow with the load,
    # and a batched pass is cheaper per image than several small ones side by side (docs/serving.md,
    # "How requests are served"). Streams are for machines with more cores than one pass uses well.
    model_threads = min(model_threads or cpus, 256)
    model_streams = model_streams or 1
    predictor = Predictor(model, runtime, device, threads=model_threads)
    name = name or default_name(model)
    FAST_PATH.labels(name).info(predictor.fast_path())
    rate, n = measured_rate(predictor, max_batch_size, model_streams)
    chosen = "--max-queue"
    if max_queue is None:
        max_queue = default_max_queue(rate, max_batch_size)
        chosen = f"{QUEUE_DELAY_S:g} s of passes, at least half of --max-batch-size"
    MAX_QUEUE.labels(name).set(max_queue)
    print(f"queue: {'no bound' if max_queue == 0 else f'at most {max_queue} images waiting'} "
          f"({chosen}; a pass of {n} images measured at {rate:.1f} images/s)", flush=True)
    batcher = Batcher(timed_forward(predictor.probabilities, name), max_batch=max_batch_size,
                      max_wait_s=batch_wait_ms / 1000, decode_threads=workers,
                      streams=model_streams, max_queue=max_queue, rate=rate)
    return ImageClassifier(name, predictor, batcher)


def serve(model, *, http_port: int = ServeOptions.http_port,
          grpc_port: int = ServeOptions.grpc_port, **options) -> None:
    """Load the model and serve it until SIGTERM/SIGINT (`build_model` has the options)."""
    check_options(ServeOptions(str(model), http_port=http_port, grpc_port=grpc_port))
    classifier = build_model(model, **options)
    from fastapi.exceptions import RequestValidationError
    from kfvision.pipelines.serve.admission import RefuseWhenFull
    from kfvision.pipelines.serve.disconnects import CancelOnDisconnect
    from kfvision.pipelines.serve.kservemodel import Overloaded
    from kfvision.pipelines.serve.protocol import V2DataPlane
    from kserve.model_server import app

    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(Overloaded, _overloaded)
    app.add_middleware(CancelOnDisconnect)
    # added last, so it runs first: a full queue refuses before the body is read
    app.add_middleware(RefuseWhenFull, refusal=classifier.refusal, respond=_refused)
    server = _import_kserve()(http_port=http_port, grpc_port=grpc_port, workers=1,
                              enable_grpc=True, enable_docs_url=False)
    # ModelServer.start hands its data plane to the REST and gRPC servers it starts.
    server.dataplane = V2DataPlane(model_registry=server.registered_models)
    p = classifier.predictor
    print(f"serving {p.source} ({p.runtime}, {len(p.classes)} classes) as "
          f"'{classifier.name}': REST on port {http_port} (POST "
          f"/v1/models/{classifier.name}:predict, /v2/models/{classifier.name}/infer), v2 gRPC "
          f"on port {grpc_port}", flush=True)
    server.start([classifier])
