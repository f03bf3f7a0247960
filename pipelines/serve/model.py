"""The kfvision image classifier as a `kserve.Model`: the v1 and v2 request formats, checked.

    v1  POST /v1/models/NAME:predict  {"instances": [{"image": {"b64": "<image file>"}}, ...]}
        -> {"predictions": [{"label": "<class>", "probabilities": {"<class>": p, ...}}, ...]}
    v2  POST /v2/models/NAME/infer    {"inputs": [{"name": "image", "datatype": "BYTES",
                                       "shape": [n], "data": ["<base64 image file>", ...]}]}
        -> outputs "label" (BYTES [n]) and "probabilities" (FP32 [n, classes])

A request that is not one of these gets `kserve.errors.InvalidInput` (HTTP 400, a JSON body
naming what was wrong, and where); the model server goes on serving. Images are decoded on the
batcher's threads and classified in batches shared with concurrent requests (`Batcher`).
"""

import base64
import binascii
import uuid

import torch
from kserve import Model
from kserve.errors import InvalidInput
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse

from pipelines.serve.batcher import Batcher
from trainer.use.predict import InvalidImageError, Predictor

MAX_INSTANCES = 64  # images in one request at most (docs/serving.md)
V1_EXAMPLE = '{"instances": [{"image": {"b64": "<base64 of an image file>"}}]}'


def _b64_image(text, where: str, predictor: Predictor) -> torch.Tensor:
    """One base64 image file -> the model's uint8 input (runs on a decode thread)."""
    if not isinstance(text, str):
        raise InvalidImageError(f"{where} must be a base64 string, not {type(text).__name__}")
    try:
        data = base64.b64decode(text, validate=True)
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


def v2_images(request: InferRequest) -> list[tuple]:
    """[(base64 text, where)] of a v2 request: one BYTES input of shape [n]."""
    if len(request.inputs) != 1:
        raise InvalidInput(f"expected exactly one input (BYTES, shape [n], base64 image files), "
                           f"got {len(request.inputs)}")
    inp = request.inputs[0]
    where = f"input '{inp.name}'"
    if inp.datatype != "BYTES":
        raise InvalidInput(f"{where} has datatype {inp.datatype}; it must be BYTES (base64 "
                           "image files)")
    data = inp.data
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
        self.ready = True  # the model was loaded before the server starts, once

    def load(self) -> bool:
        return self.ready

    def get_input_types(self) -> list[dict]:
        return [{"name": "image", "datatype": "BYTES", "shape": [-1]}]

    def get_output_types(self) -> list[dict]:
        return [{"name": "label", "datatype": "BYTES", "shape": [-1]},
                {"name": "probabilities", "datatype": "FP32",
                 "shape": [-1, len(self.predictor.classes)]}]

    async def classify(self, images: list[tuple]):
        """(labels, probabilities [n, classes]) of [(base64 text, where)]."""
        try:
            decoded = await self.batcher.decode(
                lambda text, where: _b64_image(text, where, self.predictor), images)
        except InvalidImageError as e:
            raise InvalidInput(str(e)) from e
        probs = await self.batcher.submit(torch.stack(decoded))
        classes = self.predictor.classes
        return [classes[i] for i in probs.argmax(axis=1).tolist()], probs

    async def predict(self, payload, headers=None, response_headers=None):
        if isinstance(payload, InferRequest):
            labels, probs = await self.classify(v2_images(payload))
            return InferResponse(
                response_id=payload.id or str(uuid.uuid4()), model_name=self.name,
                infer_outputs=[InferOutput("label", [len(labels)], "BYTES", data=labels),
                               InferOutput("probabilities", list(probs.shape), "FP32",
                                           data=probs)])
        labels, probs = await self.classify(v1_images(payload))
        classes = self.predictor.classes
        return {"predictions": [
            {"label": label, "probabilities": dict(zip(classes, p.tolist()))}
            for label, p in zip(labels, probs)]}

    def stop(self) -> None:
        self.batcher.close()
