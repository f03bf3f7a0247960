"""`kfvision serve`: a trained model (or its ONNX export) behind KServe's model server."""

import argparse

from kfvision.pipelines.clients.s3 import S3Options, is_s3
from kfvision.pipelines.serve.server import ServeOptions
from kfvision.trainer.options import add_flags, check_options, options_of

EPILOG = """\
serve, then query (docs/serving.md):
  kfvision serve --model models/r18-trained --name digits --http-port 8080
  curl localhost:8080/v2/health/ready
  curl -H 'Content-Type: application/json' localhost:8080/v1/models/digits:predict \\
      -d "{\\"instances\\": [{\\"image\\": {\\"b64\\": \\"$(base64 -w0 cat.jpg)\\"}}]}"
"""


def _serve(args) -> int:
    from kfvision.pipelines.clients.models import local_model
    from kfvision.pipelines.serve.server import default_name, serve

    check_options(ServeOptions(**{o.name: getattr(args, o.name)
                                  for o in options_of(ServeOptions)}))  # before any download
    name = args.name
    if name is None and is_s3(args.model):  # named after the URI, not the cache's folder
        last = args.model.rstrip("/").rpartition("/")[2]
        name = default_name(last.removesuffix(".onnx"))
    elif name is None and args.model.startswith("models:/"):  # models:/NAME/1: NAME
        name = default_name(args.model[len("models:/"):].split("/")[0].split("@")[0])
    elif name is None and args.model.startswith("model-registry://"):  # [HOST/]NAME/VERSION
        parts = args.model[len("model-registry://"):].split("/")
        name = default_name(parts[-2] if len(parts) > 1 else parts[0])
    model = local_model(args.model, args.max_connections, onnx_file=True)
    serve(model, name=name, http_port=args.http_port, grpc_port=args.grpc_port,
          workers=args.workers, model_threads=args.model_threads,
          model_streams=args.model_streams, device=args.device, runtime=args.runtime,
          max_batch_size=args.max_batch_size, batch_wait_ms=args.batch_wait_ms,
          max_queue=args.max_queue)
    return 0


def register(subparsers, help: str) -> None:
    """Add `kfvision serve` to the `kfvision` command line's subparsers."""
    s = subparsers.add_parser("serve", help=help, epilog=EPILOG,
                              description="Serve a trained model with KServe's model server: "
                              "the v1 and v2 inference protocols over REST, v2 over gRPC.",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(s, options_of(ServeOptions))
    add_flags(s, options_of(S3Options))
    s.set_defaults(func=_serve)
