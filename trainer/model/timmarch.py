"""timm's models as architectures: `kfvision model timm/NAME OUT` (`pip install kfvision[timm]`).

NAME is any name `timm.list_models()` knows, with or without its pretrained tag
(`convnext_tiny.fb_in22k_ft_in1k`). The model is `timm.create_model(NAME, num_classes=...)`;
its head is found as torchvision's are (trainer/model/arch.py: the tensors whose shape follows
the number of classes); `--dropout` and `--stochastic-depth` are timm's `drop_rate` and
`drop_path_rate`. `--pretrained` takes the weights from the Hugging Face hub (network) and
stores them in the model directory, as `--weights FILE` does offline.

The timm version that wrote a model directory is in its spec (`timm`). A different installed
timm builds the model anyway, with a warning naming both versions: timm keeps its models'
parameter names within a release line, and a model whose weights no longer fit is refused by
the strict load with a message that says which timm to install.
"""

import contextlib
import logging

import torch

from kfvision.trainer.errors import InvalidModelDirectoryError, InvalidParameterError

log = logging.getLogger("trainer")
PREFIX = "timm/"
EXTRA = "kfvision[timm]"
# ModelOptions' names -> timm.create_model's keywords
KWARGS = {"dropout": "drop_rate", "stochastic_depth": "drop_path_rate"}


_nothing = contextlib.nullcontext


def require():
    """The timm module, or InvalidParameterError naming the extra to install."""
    try:
        import timm
    except ImportError as e:
        raise InvalidParameterError(
            f"timm models need timm, which is not installed here ({e}): pip install "
            f"'{EXTRA}' (or the image's timm variant).") from e
    return timm


def installed_version() -> str:
    return require().__version__


def model_name(arch: str) -> str:
    """timm's name of architecture `arch` ("timm/NAME"), checked against timm's list."""
    timm = require()
    name = arch.removeprefix(PREFIX)
    if not timm.is_model(name.split(".")[0]):
        import difflib

        close = difflib.get_close_matches(name.split(".")[0], timm.list_models(), n=5)
        raise InvalidParameterError(
            f"{arch}: timm {timm.__version__} has no model {name!r}"
            f"{' (closest: ' + ', '.join(close) + ')' if close else ''}; `timm.list_models()` "
            "lists them.")
    return name


def create(arch: str, num_classes: int, kwargs: dict, *, meta: bool = False):
    """timm's model of `arch` with a `num_classes` head (`kwargs`: timm's, from `keywords`)."""
    timm = require()
    name = model_name(arch)
    with (torch.random.fork_rng(devices=[]) if meta else _nothing(),
          torch.device("meta") if meta else _nothing()):
        return timm.create_model(name, pretrained=False, num_classes=num_classes, **kwargs)


def keywords(family: dict) -> dict:
    """timm.create_model's keywords of ModelOptions' values `family`."""
    return {KWARGS[k]: v for k, v in family.items() if k in KWARGS}


def pretrained_state(arch: str) -> dict:
    """The hub's pretrained weights of `arch` (network, or the hub's cache)."""
    timm = require()
    try:
        model = timm.create_model(model_name(arch), pretrained=True)
    except (OSError, RuntimeError) as e:  # offline: huggingface_hub raises OSError subclasses
        raise InvalidModelDirectoryError(
            f"could not get the pretrained weights of {arch} from the Hugging Face hub ({e}). "
            "Allow network access (or set HF_HOME to a warm cache), or pass --weights FILE "
            "with a local state_dict instead.") from e
    return model.state_dict()


def check_version(written: str | None, arch: str) -> None:
    """Warn when the installed timm is not the one that wrote the model directory."""
    now = installed_version()
    if written and written != now:
        log.warning("WARNING: %s was written with timm %s; timm %s is installed. If its weights "
                    "do not fit, pip install timm==%s", arch, written, now, written)


def mismatch_hint(written: str | None) -> str:
    """What to do when a timm model's weights do not fit (for the strict load's message)."""
    now = installed_version()
    return (f" It was written with timm {written}, timm {now} is installed: pip install "
            f"timm=={written}." if written and written != now else "")
