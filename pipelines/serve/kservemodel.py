"""The kfvision image classifier as a `kserve.Model`: the v1 and v2 request formats, checked.

    v1  POST /v1/models/NAME:predict  {"instances": [{"image": {"b64": "<image file>"}}, ...]}
        -> {"predictions": [{"label": "<class>", "probabilities": {"<class>": p, ...}}, ...]}
    v2  POST /v2/models/NAME/infer    {"inputs": [{"name": "image", "datatype": "BYTES",
                                       "shape": [n], "data": ["<base64 image file>", ...]}]}
        (or the binary tensor extension, or gRPC ModelInfer: elements the image files' bytes)
        -> outputs "label" (BYTES [n]) and "probabilities" (FP32 [n, classes])

A v2 element is the base64 text of an image file (a JSON string, or bytes), or the file itself
(bytes): every image format's signature has bytes outside the base64 alphabet, so the two never
meet. A request that is not one of these gets `kserve.errors.InvalidInput` (HTTP 400, gRPC
INVALID_ARGUMENT, a message naming what was wrong, and where); the model server goes on serving.
Images are decoded on the batcher's threads and classified in batches shared with concurrent
requests (`Batcher`). A request the batcher's queue has no room for gets `Overloaded` (HTTP 503
with Retry-After, gRPC RESOURCE_EXHAUSTED) at once.
"""

import asyncio
import base64
import binascii
import re
import struct
import uuid

import torch
from grpc_interceptor.exceptions import ResourceExhausted
from kfvision.pipelines.serve.batcher import Batcher, QueueFull
from kfvision.pipelines.serve.metrics import ABANDONED, REFUSED, timed_decode
from kfvision.trainer.use.predict import InvalidImageError, Predictor
from kserve import Model
from kserve.errors import InvalidInput
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse

MAX_INSTANCES = 64  # images in one request at most (docs/serving.md)
V1_EXAMPLE = '{"instances": [{"image": {"b64": "<base64 of an image file>"}}]}'
BASE64 = re.compile(rb"[A-Za-z0-9+/]*={0,2}")


class Overloaded(ResourceExhausted):
    """A `QueueFull` refusal as KServe's servers send it: over gRPC, KServe's exception
    interceptor aborts with a GrpcException's own code (RESOURCE_EXHAUSTED) and details, without
    logging it; over REST, `kfvision.pipelines.serve.server` answers it with 503 and Retry-After."""

    def __init__(self, full: QueueFull):
        super().__init__(str(full))
        self.retry_after = full.retry_after


def _image(element, where: str, predictor: Predictor) -> torch.Tensor:
    """One image file, as base64 text (str or bytes) or as its bytes -> the model's uint8 input
    (runs on a decode thread)."""
    if isinstance(element, bytes) and not BASE64.fullmatch(element):
        return predictor.preprocess(element, where)  # the file itself
    if not isinstance(element, (str, bytes)):
        raise InvalidImageError(f"{where} must be a base64 string, not "
                                f"{type(element).__name__}")
    try:
        data = base64.b64decode(element, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidImageError(f"{where} is not valid base64 ({e})") from e
    return predictor.preprocess(data, where)


def _count(n: int, what: str) -> None:
    if n == 0:
        raise InvalidInput(f"{what} is empty: send at least one image")
    if n > MAX_INSTANCES:
        raise InvalidInput(f"{what} has {n} images; at most {MAX_INSTANCES} are accepted in one "
                           "request: split it")


def v1_images(payload) -> list[tuple]:
    """[(base64 text, where)] of a v1 request body; InvalidInput when it is not one."""
    if not isinstance(payload, dict):
        raise InvalidInput(f"the request body must be a JSON object like {V1_EXAMPLE}, not "
                           f"{type(payload).__name__}")
    instances = payload.get("instances")
    if not isinstance(instances, list):
        raise InvalidInput("'instances' is missing or not a list; send " + V1_EXAMPLE)
    _count(len(instances), "'instances'")
    out = []
    for i, inst in enumerate(instances):
        image = inst.get("image") if isinstance(inst, dict) else None
        if not isinstance(image, dict) or "b64" not in image:
            raise InvalidInput(f"instances[{i}] must be {{\"image\": {{\"b64\": \"...\"}}}}")
        out.append((image["b64"], f"instances[{i}].image.b64"))
    return out


def _elements(inp) -> list:
    """A v2 input's elements: from JSON (str), gRPC `contents` or the binary extension (bytes);
    or, when the message holds none, gRPC's raw_input_contents (4-byte length, bytes, ...)."""
    if inp.data:
        return inp.data
    try:
        return inp.as_numpy().reshape(-1).tolist()
    except (ValueError, struct.error) as e:
        raise InvalidInput(f"input '{inp.name}' has shape {list(inp.shape)}, but its data (or raw "
                           "contents: each element a 4-byte little-endian length, then its "
                           "bytes) does not hold that many elements") from e


def v2_images(request: InferRequest) -> list[tuple]:
    """[(image element, where)] of a v2 request: one BYTES input of shape [n]."""
    if len(request.inputs) != 1:
        raise InvalidInput(f"expected exactly one input (BYTES, shape [n], base64 image files), "
                           f"got {len(request.inputs)}")
    inp = request.inputs[0]
    where = f"input '{inp.name}'"
    if inp.datatype != "BYTES":
        raise InvalidInput(f"{where} has datatype {inp.datatype}; it must be BYTES (base64 "
                           "image files)")
    data = _elements(inp)
    if not isinstance(data, list) or any(isinstance(d, list) for d in data):
        raise InvalidInput(f"{where}: 'data' must be a flat list of base64 strings")
    if list(inp.shape) != [len(data)]:
        raise InvalidInput(f"{where} has shape {list(inp.shape)} for {len(data)} elements; it "
                           f"must be [{len(data)}] (one element per image)")
    _count(len(data), where)
    return [(d, f"{where}[{i}]") for i, d in enumerate(data)]


class ImageClassifier(Model):
    """A loaded `Predictor` served under `name`, its requests batched by `batcher`."""

    def __init__(self, name: str, predictor: Predictor, batcher: Batcher):
        super().__init__(name)
        self.predictor, self.batcher = predictor, batcher
        self._decode = timed_decode(lambda element, where: _image(element, where, predictor), name)
        self._refused, self._abandoned = REFUSED.labels(name), ABANDONED.labels(name)
        self.ready = True  # the model was loaded before the server starts, once

    def load(self) -> bool:
        return self.ready

    def get_input_types(self) -> list[dict]:
        return [{"name": "image", "datatype": "BYTES", "shape": [-1]}]

    def get_output_types(self) -> list[dict]:
        return [{"name": "label", "datatype": "BYTES", "shape": [-1]},
                {"name": "probabilities", "datatype": "FP32",
                 "shape": [-1, len(self.predictor.classes)]}]

    def refusal(self) -> "Overloaded | None":
        """The refusal any request would get now (the queue has no room even for one image), or
        None; counted as one."""
        try:
            self.batcher.admit(1)
        except QueueFull as e:
            self._refused.inc()
            return Overloaded(e)
        return None

    async def classify(self, images: list[tuple]):
        """(labels, probabilities [n, classes]) of [(image element, where)]."""
        try:
            decoded = await self.batcher.decode(self._decode, images)
            probs = await self.batcher.submit(torch.stack(decoded))
        except QueueFull as e:
            self._refused.inc()
            raise Overloaded(e) from None
        except InvalidImageError as e:
            raise InvalidInput(str(e)) from e
        except asyncio.CancelledError:  # the client went away (REST or gRPC)
            self._abandoned.inc()
            raise
        classes = self.predictor.classes
        return [classes[i] for i in probs.argmax(axis=1).tolist()], probs

    async def predict(self, payload, headers=None, response_headers=None):
        if isinstance(payload, InferRequest):
            labels, probs = await self.classify(v2_images(payload))
            # Both outputs as lists: KServe's to_grpc puts a list in `contents`, or, for a request
            # that came in raw_input_contents, in raw_output_contents; an array always goes raw
            # (and fails in to_grpc's list check), and a mix of the two misleads clients.
            return InferResponse(
                response_id=payload.id or str(uuid.uuid4()), model_name=self.name,
                infer_outputs=[InferOutput("label", [len(labels)], "BYTES", data=labels),
                               InferOutput("probabilities", list(probs.shape), "FP32",
                                           data=probs.reshape(-1).tolist())],
                use_binary_outputs=payload.use_binary_outputs,
                requested_outputs=payload.request_outputs)
        labels, probs = await self.classify(v1_images(payload))
        classes = self.predictor.classes
        return {"predictions": [
            {"label": label, "probabilities": dict(zip(classes, p.tolist()))}
            for label, p in zip(labels, probs)]}

    def stop(self) -> None:
        self.batcher.close()
