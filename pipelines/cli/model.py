"""`kfvision model resnet|densenet`: untrained model directories; `kfvision push`: a model
directory up to object storage."""

from kfvision.pipelines.clients.s3 import S3Options
from kfvision.trainer.options import HelpFormatter, add_flags, options_of
from kfvision.trainer.presets import ARCHITECTURES


def _model(args) -> int:
    from kfvision.trainer.model.arch import write_untrained_model

    spec = write_untrained_model(
        args.out, args.name, pretrained=args.pretrained, weights=args.weights,
        zero_init_residual=getattr(args, "zero_init_residual", False),
        memory_efficient=getattr(args, "memory_efficient", False))
    source = ("ImageNet weights" if spec.pretrained else
              f"weights from {args.weights}" if args.weights else "random initialisation")
    print(f"wrote untrained {spec.arch} ({source}) to {args.out}")
    return 0


def _push(args) -> int:
    from pathlib import Path

    from kfvision.pipelines.clients.s3sync import push
    from kfvision.trainer.errors import InvalidModelDirectoryError
    from kfvision.trainer.model.scripted import has_script_model, read_script_model

    model = Path(args.dir)
    last = "model.json"
    if not (model / last).is_file() and has_script_model(model):  # a training script's
        last = read_script_model(model).path.name  # its network last: no network, no model
    elif not ((model / "model.json").is_file() or (model / "spec.json").is_file()):
        raise InvalidModelDirectoryError(
            f"{model} is not a model directory (no model.json or spec.json, nor a script's "
            "model.pt2, model.pt or model.onnx): give the --out of `kfvision train` (or a "
            "`kfvision model` directory, or the model directory your script wrote).")
    keys = push(model, args.uri, max_connections=args.max_connections, skip=("checkpoints",),
                last=last, overwrite=args.overwrite)
    print(f"pushed {len(keys)} file(s) of {model} to {args.uri.rstrip('/')}/ (serve, score or "
          f"deploy it as --model {args.uri})")
    return 0


def register(sub, help: dict) -> None:
    """Add `kfvision model FAMILY` (architecture names are torch-free: cheap for every command)
    and `kfvision push` (`help`: each command's one line, pipelines/cli/__init__.py's HELP)."""
    m = sub.add_parser("model", help=help["model"])
    msub = m.add_subparsers(dest="family", required=True, metavar="FAMILY")
    for family, names in ARCHITECTURES.items():  # torch-free names: cheap for every command
        f = msub.add_parser(family, help=f"{family}: {names[0]}, ... (--name)",
                            formatter_class=HelpFormatter)
        f.add_argument("out", help="output model directory")
        f.add_argument("--name", default=names[0], choices=names, help="architecture")
        w = f.add_mutually_exclusive_group()
        w.add_argument("--pretrained", action="store_true",
                       help="start from torchvision's ImageNet weights (downloaded once)")
        w.add_argument("--weights", metavar="FILE", help="start from a local state_dict file")
        if family == "resnet":
            f.add_argument("--zero-init-residual", action="store_true",
                           help="zero-init the last BN of each residual block")
        else:
            f.add_argument("--memory-efficient", action="store_true",
                           help="gradient checkpointing: less memory, slower steps")
        f.set_defaults(func=_model)

    p = sub.add_parser("push", help=help["push"],
                       formatter_class=HelpFormatter,
                       description="Upload a trained (or untrained) model directory to an s3:// "
                       "prefix, where KServe's storage initializer and `--model s3://...` of "
                       "score, serve, export and deploy read it. Its checkpoints/ stay local; "
                       "model.json goes last, so a prefix without it is no model. On a failure "
                       "what was uploaded is deleted again. See docs/data.md.")
    p.add_argument("dir", help="the model directory (e.g. the --out of `kfvision train`)")
    p.add_argument("uri", help="s3://BUCKET/PREFIX/ to upload it to")
    p.add_argument("--overwrite", action="store_true", help="replace what the prefix holds")
    add_flags(p, options_of(S3Options))
    p.set_defaults(func=_push)
