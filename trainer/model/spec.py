"""The untrained-model directory's `spec.json`: what `kfvision model` writes and training reads.

Imports neither torch nor torchvision (trainer/model/arch.py builds the model from it), so that
`kfvision train` checks a model directory before it starts anything heavy (trainer/inputs.py).
The architectures are torchvision's whole classification list (trainer/model/catalog.py, generated
from it); the options only some families take are declared once, in ModelOptions.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kfvision.trainer.errors import FamilyOptionError, InvalidModelDirectoryError, ref
from kfvision.trainer.model.catalog import OPTIONS
from kfvision.trainer.options import option, options_of
from kfvision.trainer.presets import ARCHITECTURES, family_of

SPEC_FILE = "spec.json"
WEIGHTS_FILE = "weights.pt"
SPEC_FORMAT = "kfvision.untrained-model"

# each family option: torchvision's keyword for it (the builders' own spelling)
FAMILY_OPTIONS = {"zero_init_residual": "zero_init_residual",
                  "memory_efficient": "memory_efficient", "dropout": "dropout",
                  "stochastic_depth": "stochastic_depth_prob"}


@dataclass(frozen=True)
class ModelOptions:
    """The options only some families take (catalog.OPTIONS says which): `kfvision model`'s
    flags; any other family refuses them by name (FamilyOptionError)."""

    zero_init_residual: bool = option(False, "zero-init the last BN of each residual block",
                                      doc="ResNet family: each residual block starts as the "
                                      "identity.")
    memory_efficient: bool = option(False, "gradient checkpointing: less memory, slower steps",
                                    doc="DenseNet family.")
    dropout: float | None = option(None, "dropout probability of the classifier", low=0.0,
                                   high=1.0, unset="the model's own")
    stochastic_depth: float | None = option(None, "stochastic depth (drop path) probability",
                                            low=0.0, high=1.0, unset="the model's own",
                                            doc="ConvNeXt, EfficientNet, Swin, MaxViT.")


@dataclass(frozen=True)
class ModelSpec:
    """What `kfvision model` writes and training reads. `weights` is a file in the model folder;
    the family options are None (or False) where not given (the model's own default)."""

    family: str
    arch: str
    pretrained: bool = False
    weights: str | None = None
    zero_init_residual: bool = False  # resnet: start each residual block as the identity
    memory_efficient: bool = False  # densenet: gradient checkpointing (less memory, slower)
    dropout: float | None = None
    stochastic_depth: float | None = None
    timm: str | None = None  # the timm version that wrote it (family "timm")

    def to_json(self) -> dict:
        return {"format": SPEC_FORMAT, "version": 1, **asdict(self)}

    def family_options(self) -> dict:
        """ModelOptions' values this spec sets."""
        return {o.name: getattr(self, o.name) for o in options_of(ModelOptions)
                if getattr(self, o.name) not in (None, False)}

    def family_kwargs(self) -> dict:
        """The torchvision builder keywords of the family options this spec sets."""
        return {FAMILY_OPTIONS[k]: v for k, v in self.family_options().items()}


def takers(name: str) -> list:
    """The families in which some model takes family option `name`."""
    return sorted({f for f, archs in ARCHITECTURES.items() for a in archs
                   if name in OPTIONS[a]})


TIMM, TIMM_PREFIX = "timm", "timm/"  # timm's models: trainer/model/timmarch.py
TIMM_OPTIONS = ("dropout", "stochastic_depth")


def model_family(arch: str) -> str:
    """The family of `arch`: "timm" for "timm/NAME" (checked when built), else torchvision's
    (InvalidParameterError for an unknown name)."""
    return TIMM if arch.startswith(TIMM_PREFIX) else family_of(arch)


def model_spec(arch: str, *, pretrained: bool = False, weights=None, timm: str | None = None,
               **family) -> ModelSpec:
    """The ModelSpec of `arch` (a torchvision name, or "timm/NAME") with the family options
    `family` (ModelOptions' names).

    Raises:
        InvalidParameterError: an unknown architecture (the message lists them).
        FamilyOptionError: an option set that `arch`'s builder does not take.
    """
    fam = model_family(arch)
    taken = TIMM_OPTIONS if fam == TIMM else OPTIONS[arch]
    for opt in options_of(ModelOptions):
        value = family.get(opt.name, opt.default)
        opt.check(value)
        if value not in (None, False) and opt.name not in taken:
            raise FamilyOptionError(
                f"{ref(opt.name)} is not an option of {arch} (family {fam}); the families "
                f"that take it: {', '.join(takers(opt.name))}. Leave it out for {arch}.")
    return ModelSpec(fam, arch, pretrained, weights, **family, timm=timm)


HINT = "Make one with `kfvision model resnet18 DIR` (any name `kfvision model --help` lists)."


def parse_model_spec(data: bytes, where) -> ModelSpec:
    """The ModelSpec whose `spec.json` holds `data` (its bytes), checked as far as the spec alone
    allows (format, version, architecture); no file is read. `where`: the spec's path or URI,
    for the messages.

    Raises:
        InvalidModelDirectoryError: a malformed spec or an unknown architecture.
    """
    try:
        doc = json.loads(data.decode("utf-8"))
        if doc.pop("format") != SPEC_FORMAT or doc.pop("version") != 1:
            raise ValueError("unknown format or version")
        spec = ModelSpec(**doc)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InvalidModelDirectoryError(f"{where}, the model directory's spec, is malformed "
                                         f"({e}). " + HINT) from e
    timm_model = spec.family == TIMM and spec.arch.startswith(TIMM_PREFIX)
    if not timm_model and spec.arch not in ARCHITECTURES.get(spec.family, ()):
        raise InvalidModelDirectoryError(f"{where}: unknown architecture "
                                         f"{spec.family}/{spec.arch}. " + HINT)
    return spec


def read_model_spec(model_dir) -> ModelSpec:
    """Read and validate an untrained model directory (or the spec inside a trained one)."""
    model_dir = Path(model_dir)
    path = model_dir / SPEC_FILE
    if not path.is_file():
        raise InvalidModelDirectoryError(f"{model_dir} is not a model directory (no {SPEC_FILE}). "
                                         + HINT)
    spec = parse_model_spec(path.read_bytes(), path)
    if spec.weights and not (model_dir / spec.weights).is_file():
        raise InvalidModelDirectoryError(f"{path} names weights {spec.weights!r} but "
                                         f"{model_dir / spec.weights} is missing. " + HINT)
    return spec
