"""`kfvision model NAME OUT`: untrained model directories, of any of torchvision's classification
models (the list, by family, is trainer/model/catalog.py: generated from torchvision, torch-free
so that every command's parser stays cheap)."""

import argparse
import textwrap

from kfvision.trainer.model.catalog import FAMILIES
from kfvision.trainer.model.spec import TIMM_PREFIX, ModelOptions
from kfvision.trainer.options import add_flags, options_of
from kfvision.trainer.presets import family_of


def family_listing(width: int = 96) -> str:
    """The architectures by family, one paragraph each (the help's epilog and the docs)."""
    count = sum(map(len, FAMILIES.values()))
    lines = [f"architectures ({count}, torchvision's list, by family):"]
    for family, names in FAMILIES.items():
        lines += textwrap.wrap(", ".join(names), width, initial_indent=f"  {family}: ",
                               subsequent_indent="    ")
    return "\n".join(lines)


def _arch(args) -> str:
    if args.name is not None:  # the older spelling: `kfvision model resnet DIR --name resnet18`
        if args.name not in FAMILIES.get(args.arch, ()):
            from kfvision.trainer.errors import InvalidParameterError

            names = ", ".join(FAMILIES.get(args.arch, ()))
            raise InvalidParameterError(f"--name {args.name} is not a model of family "
                                        f"{args.arch!r} ({names}); give the name alone: "
                                        "`kfvision model NAME OUT`.")
        return args.name
    return args.arch


def _model(args) -> int:
    arch = _arch(args)
    if not arch.startswith(TIMM_PREFIX):  # an unknown name is refused before torch loads (3 s)
        family_of(arch)
    from kfvision.trainer.model.arch import write_untrained_model

    family = {o.name: getattr(args, o.name) for o in options_of(ModelOptions)}
    spec = write_untrained_model(args.out, arch, pretrained=args.pretrained,
                                 weights=args.weights, **family)
    source = ("ImageNet weights" if spec.pretrained else
              f"weights from {args.weights}" if args.weights else "random initialisation")
    print(f"wrote untrained {spec.arch} ({source}) to {args.out}")
    return 0


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        text = action.help or ""
        if "(default:" in text or action.default in (None, "", [], False):
            return text
        return super()._get_help_string(action)


def register(sub, help: dict) -> None:
    """Add `kfvision model NAME OUT` (`help`: each command's one line, pipelines/cli/__init__.py's
    HELP)."""
    m = sub.add_parser("model", help=help["model"], formatter_class=_Formatter,
                       epilog=family_listing())
    m.add_argument("arch", metavar="NAME", help="architecture (listed below)")
    m.add_argument("out", help="output model directory")
    m.add_argument("--name", default=None, help=argparse.SUPPRESS)  # `model FAMILY --name A`
    w = m.add_mutually_exclusive_group()
    w.add_argument("--pretrained", action="store_true",
                   help="start from torchvision's ImageNet weights (downloaded once)")
    w.add_argument("--weights", metavar="FILE", help="start from a local state_dict file")
    add_flags(m.add_argument_group("family options (refused by the families that lack them)"),
              options_of(ModelOptions))
    m.set_defaults(func=_model)
