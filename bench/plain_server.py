"""The plain way to serve a classifier: stdlib HTTP, PIL + torchvision transforms, one forward per
request. The baseline `bench.serve` measures `kfvision serve` against.

It takes the v1 request body (`{"instances": [{"image": {"b64": ...}}]}`) at any path and
answers `{"predictions": [{"label": ...}]}`: the same model directory, the same preprocessing
recipe (torchvision's resize / centre crop / normalise), written as a tutorial would.

    python -m bench.plain_server --model MODEL_DIR --port 8090
"""

import argparse
import base64
import io
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from PIL import Image
from torchvision import transforms

from kfvision.trainer.model.trained import load_trained_model


def make_handler(model, classes, preprocess):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the clients use

        def do_GET(self):  # health
            self._reply(200, {"ready": True})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            images = []
            for inst in body["instances"]:
                data = base64.b64decode(inst["image"]["b64"])
                images.append(preprocess(Image.open(io.BytesIO(data)).convert("RGB")))
            with torch.inference_mode():
                probs = model(torch.stack(images)).softmax(dim=1)
            self._reply(200, {"predictions": [
                {"label": classes[int(p.argmax())],
                 "probabilities": dict(zip(classes, p.tolist()))} for p in probs]})

        def _reply(self, status, obj):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # no line per request
            pass

    return Handler


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=8090)
    a = p.parse_args(argv)
    model, info = load_trained_model(a.model)
    size = info["image_size"]
    resize = ([transforms.Resize(int(size / 0.875)), transforms.CenterCrop(size)]
              if info["eval_preset"] == "standard" else [transforms.Resize((size, size))])
    preprocess = transforms.Compose([*resize, transforms.ToTensor(),
                                     transforms.Normalize(info["mean"], info["std"])])
    ThreadingHTTPServer.request_queue_size = 128  # the default 5 resets 16 clients' connects
    server = ThreadingHTTPServer(("127.0.0.1", a.port),
                                 make_handler(model, info["classes"], preprocess))
    print(f"plain server on port {a.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
