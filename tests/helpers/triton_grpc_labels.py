"""tritonclient's gRPC client in a process of its own: prints {"raw": labels, "base64": labels}.

    python tests/helpers/triton_grpc_labels.py HOST:PORT MODEL FILE...

Its own process because tritonclient.grpc and kserve register the same protobuf names
(`inference.ServerLiveRequest`, ...) and cannot both be imported into one process.
"""

import base64
import json
import sys
from pathlib import Path

import numpy as np
import tritonclient.grpc as triton


def labels(client, model: str, elements: list[bytes]) -> list[str]:
    inp = triton.InferInput("image", [len(elements)], "BYTES")
    inp.set_data_from_numpy(np.array(elements, dtype=np.object_))  # raw_input_contents
    result = client.infer(model, [inp])
    assert result.as_numpy("probabilities").shape[0] == len(elements)
    return [label.decode() for label in result.as_numpy("label")]


def main(target: str, model: str, paths: list[str]) -> None:
    files = [Path(p).read_bytes() for p in paths]
    client = triton.InferenceServerClient(target)
    print(json.dumps({"raw": labels(client, model, files),
                      "base64": labels(client, model, [base64.b64encode(f) for f in files])}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
