"""`kfvision serve`: a trained model behind KServe's model server: REST (v1 and v2 protocols)
and the v2 protocol over gRPC.

One process holds the model, loaded once; requests are decoded on `decode_threads` threads and
batched into forward passes (pipelines/serve/batcher.py). Scale out with replicas (an
InferenceService's min/max replicas), not with processes on one machine.
"""

import re
import sys
from pathlib import Path

from trainer.errors import check_choice, check_range

# The ports are KServe's defaults (kserve 0.21 kserve/constants/constants.py DEFAULT_HTTP_PORT,
# DEFAULT_GRPC_PORT), which an InferenceService's predictor container is expected to serve on.
DEFAULTS = {"http_port": 8080, "grpc_port": 8081, "max_batch_size": 32, "batch_wait_ms": 5}


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


async def _invalid_request(request, exc):
    """FastAPI's body validation (v2 requests) as the other errors look: 400 {"error": ...}."""
    from fastapi.responses import ORJSONResponse

    problems = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}"
                         for e in exc.errors()[:4])
    return ORJSONResponse(status_code=400, content={
        "error": f"the request body is not a v2 inference request ({problems})"})


def build_model(model, *, name: str | None = None, runtime: str | None = None,
                device: str = "cpu", workers: int | None = None,
                model_threads: int | None = None, model_streams: int | None = None,
                max_batch_size: int = DEFAULTS["max_batch_size"],
                batch_wait_ms: float = DEFAULTS["batch_wait_ms"]):
    """The loaded `ImageClassifier` for a trained model directory or an ONNX export."""
    _import_kserve()
    from pipelines.serve.batcher import Batcher
    from pipelines.serve.metrics import FAST_PATH, timed_forward
    from pipelines.serve.model import ImageClassifier
    from trainer.distributed import usable_cpus
    from trainer.use.predict import Predictor

    check_choice("device", device, ("cpu", "cuda"))
    check_range("max-batch-size", max_batch_size, 1, 1024)
    check_range("batch-wait-ms", batch_wait_ms, 0, 1000)
    cpus = usable_cpus()  # a container's CPU limit, not the node's cores
    workers = workers or cpus
    check_range("workers", workers, 1, 256)
    # One forward pass at a time on all the cores, by default: batches then grow with the load,
    # and a batched pass is cheaper per image than several small ones side by side (docs/serving.md,
    # "How requests are served"). Streams are for machines with more cores than one pass uses well.
    model_threads = model_threads or cpus
    check_range("model-threads", model_threads, 1, 256)
    model_streams = model_streams or 1
    check_range("model-streams", model_streams, 1, 256)
    predictor = Predictor(model, runtime, device, threads=model_threads)
    name = name or default_name(model)
    FAST_PATH.labels(name).info(predictor.fast_path())
    batcher = Batcher(timed_forward(predictor.probabilities, name), max_batch=max_batch_size,
                      max_wait_s=batch_wait_ms / 1000, decode_threads=workers,
                      streams=model_streams)
    return ImageClassifier(name, predictor, batcher)


def serve(model, *, http_port: int = DEFAULTS["http_port"],
          grpc_port: int = DEFAULTS["grpc_port"], **options) -> None:
    """Load the model and serve it until SIGTERM/SIGINT (`build_model` has the options)."""
    check_range("http-port", http_port, 1, 65535)
    check_range("grpc-port", grpc_port, 1, 65535)
    classifier = build_model(model, **options)
    from fastapi.exceptions import RequestValidationError
    from kserve.model_server import app

    from pipelines.serve.protocol import V2DataPlane

    app.add_exception_handler(RequestValidationError, _invalid_request)
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
