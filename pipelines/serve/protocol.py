"""v2 REST request bodies read as every Open Inference Protocol client sends them.

KServe's data plane (kserve 0.21, protocol/dataplane.py and protocol/infer_type.py) fails two
common REST forms, so `V2DataPlane` reads those bodies itself:

- A JSON body sent with no JSON Content-Type (tritonclient's JSON mode sends none). FastAPI then
  passes the body on as bytes, and `DataPlane.decode_inference_request` demands the binary
  extension's Inference-Header-Content-Length header: a 400. Without that header the whole body
  is the JSON header, as the binary tensor extension says.
- The binary tensor extension carrying raw bytes in a BYTES input (an image file, the natural
  way to send one). `InferRequest.from_bytes` turns every element into a UTF-8 str
  (`set_data_from_numpy(binary_data=False)`), which an image file is not: an InferenceError,
  a 500. Here the elements stay bytes.

A body that is not a v2 request is an `InvalidInput` (400) saying what was wrong. JSON bodies
sent as JSON, and gRPC requests, take KServe's own path.
"""

import struct

import numpy as np
import orjson
from kserve.constants.constants import INFERENCE_CONTENT_LENGTH_HEADER
from kserve.errors import InvalidInput
from kserve.protocol.dataplane import DataPlane
from kserve.protocol.infer_type import InferInput, InferRequest, RequestedOutput
from kserve.utils.numpy_codec import to_np_dtype


def bytes_elements(raw: bytes, where: str) -> list[bytes]:
    """The elements of a BYTES tensor in the binary extension's layout: each one a 4-byte
    little-endian length, then that many bytes."""
    out, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidInput(f"{where}: the binary data ends inside an element's 4-byte length")
        (n,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + n > len(raw):
            raise InvalidInput(f"{where}: element {len(out)} declares {n} bytes but only "
                               f"{len(raw) - offset} follow")
        out.append(raw[offset:offset + n])
        offset += n
    return out


def _binary_data(spec: dict, raw: bytes, where: str) -> list:
    if spec["datatype"] == "BYTES":
        return bytes_elements(raw, where)
    dtype = to_np_dtype(spec["datatype"])
    if dtype is None or len(raw) % np.dtype(dtype).itemsize:
        raise InvalidInput(f"{where}: {len(raw)} bytes are no tensor of {spec['datatype']}")
    return np.frombuffer(raw, dtype=dtype).tolist()


def _input(spec, i: int, body: bytes, offset: int) -> tuple[InferInput, int]:
    """inputs[i] of the JSON header, its binary data read from body[offset:]; and the offset
    after it."""
    where = f"inputs[{i}]"
    if not (isinstance(spec, dict) and isinstance(spec.get("name"), str)
            and isinstance(spec.get("datatype"), str) and isinstance(spec.get("shape"), list)
            and all(isinstance(d, int) for d in spec["shape"])):
        raise InvalidInput(f"{where} must be an object with 'name', 'datatype' and 'shape' "
                           "(a list of integers)")
    parameters = spec.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput(f"{where}.parameters must be an object")
    size = parameters.get("binary_data_size")
    if "data" in spec:
        data = spec["data"]
    elif size is not None:
        if not isinstance(size, int) or size < 0 or offset + size > len(body):
            raise InvalidInput(f"{where}.parameters.binary_data_size is {size!r}, but "
                               f"{len(body) - offset} bytes of binary data are left in the body")
        data = _binary_data(spec, body[offset:offset + size], f"input '{spec['name']}'")
        offset += size
    else:
        raise InvalidInput(f"{where} has neither 'data' nor parameters.binary_data_size")
    return InferInput(spec["name"], spec["shape"], spec["datatype"], data, parameters), offset


def read_request(body: bytes, json_length: str | None, model_name: str) -> InferRequest:
    """The v2 request in `body`: a JSON header of `json_length` bytes (the
    Inference-Header-Content-Length header; None: all of the body), then the binary data of the
    inputs that declare a binary_data_size, in their order."""
    try:
        n = len(body) if json_length is None else int(json_length)
    except ValueError:
        n = -1
    if not 0 <= n <= len(body):
        raise InvalidInput(f"the {INFERENCE_CONTENT_LENGTH_HEADER} header is {json_length!r}; it "
                           f"must be the length of the JSON header, at most the body's "
                           f"{len(body)} bytes")
    try:
        doc = orjson.loads(body[:n])
    except orjson.JSONDecodeError as e:
        raise InvalidInput(f"the request body is not a v2 inference request: its JSON header "
                           f"does not parse ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise InvalidInput("the request body is not a v2 inference request: 'inputs' is "
                           "missing or not a list")
    inputs, offset = [], n
    for i, spec in enumerate(doc["inputs"]):
        inp, offset = _input(spec, i, body, offset)
        inputs.append(inp)
    outputs = doc.get("outputs")
    if outputs is not None and (not isinstance(outputs, list) or not all(
            isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs)):
        raise InvalidInput("'outputs' must be a list of objects with a 'name'")
    parameters = doc.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be an object")
    return InferRequest(model_name, inputs, request_id=doc.get("id"), parameters=parameters,
                        request_outputs=[RequestedOutput(o["name"], o.get("parameters"))
                                         for o in outputs] if outputs else None)


class V2DataPlane(DataPlane):
    """KServe's data plane, reading v2 REST bodies that arrive as bytes with `read_request`."""

    def decode_inference_request(self, body, headers, model_name):
        if isinstance(body, bytes):
            return read_request(body, headers.get(INFERENCE_CONTENT_LENGTH_HEADER), model_name)
        return super().decode_inference_request(body, headers, model_name)
