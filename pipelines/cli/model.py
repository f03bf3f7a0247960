"""`kfvision model resnet|densenet`: untrained model directories."""

from kfvision.trainer.options import HelpFormatter
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


def register(sub, help: dict) -> None:
    """Add `kfvision model FAMILY` (architecture names are torch-free: cheap for every command)
    (`help`: each command's one line, pipelines/cli/__init__.py's HELP)."""
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
