"""Model registry: the torchvision model an untrained-model directory describes (its
`spec.json`, trainer/model/spec.py, and an optional `weights.pt`), and writing such a directory.

Every name of torchvision's classification list is an architecture (trainer/model/catalog.py,
generated from it). Nothing here knows a family by name: what differs between families is found
on the model itself, built on the meta device (no memory, no time):
- the classifier head is the tensors whose shape follows the number of classes (`fc`,
  `classifier[-1]`, `heads.head`, `head`, SqueezeNet's last convolution...): torchvision's builders
  all take `num_classes`, so the model is built with the data's classes and the backbone weights
  are loaded around it;
- a family option (trainer/model/spec.py FAMILY_OPTIONS) is the builder keyword it takes;
- an image size fits when a forward pass of that size goes through.
Auxiliary heads (GoogLeNet, Inception v3) are left out (`aux_logits=False`): one output to train,
score and export. A Vision Transformer is built for the training image size (`image_size`), its
position embedding resized by torchvision's own `interpolate_embeddings` where weights came from
another size.
"""

import collections
import functools
import inspect
import json
from pathlib import Path

import torch
import torchvision
from torch import nn

from kfvision.trainer.errors import (
    ImageSizeError,
    InvalidModelDirectoryError,
    InvalidParameterError,
)
from kfvision.trainer.fileio import atomic_write, atomic_write_bytes
from kfvision.trainer.model import timmarch
from kfvision.trainer.model.catalog import SIZES
from kfvision.trainer.model.spec import (
    SPEC_FILE,
    TIMM_PREFIX,
    WEIGHTS_FILE,
    ModelSpec,
    model_spec,
)


def _builder_kwargs_taken(arch: str, kwarg: str) -> bool:
    """Whether torchvision's builder of `arch` takes keyword `kwarg`: its model class names it
    (a class that takes **kwargs and drops them, as ConvNeXt's, does not count) and the builder
    passes it on (Swin's, ConvNeXt's and MaxViT's builders fix their stochastic depth)."""
    if not _takes(arch, kwarg):
        return False
    value = True if kwarg in ("zero_init_residual", "memory_efficient") else 0.1
    try:
        _meta_model(arch, ((kwarg, value),))
    except TypeError:  # "got multiple values for keyword argument"
        return False
    return True


def _takes(arch: str, kwarg: str) -> bool:
    """Whether the model class of `arch` names `kwarg` (aux_logits, image_size, dropout...)."""
    param = _class_parameters(arch).get(kwarg)
    return param is not None and param.kind != inspect.Parameter.VAR_KEYWORD


@functools.cache
def _class_parameters(arch: str) -> dict:
    model = _meta_model(arch, ())
    return dict(inspect.signature(type(model).__init__).parameters)


def _kwargs(spec: ModelSpec, image_size: int | None = None) -> dict:
    """The builder keywords of `spec` beyond num_classes."""
    if _is_timm(spec.arch):
        return timmarch.keywords(spec.family_options())
    kw = spec.family_kwargs()
    if _takes(spec.arch, "aux_logits"):
        kw["aux_logits"] = False
        # ported weights expect torchvision's input transform (what the builder sets with weights)
        kw["transform_input"] = bool(spec.pretrained)
    if image_size and _takes(spec.arch, "image_size"):  # ViT: position embedding per size
        kw["image_size"] = image_size
    return kw


def _is_timm(arch: str) -> bool:
    return arch.startswith(TIMM_PREFIX)


def _build(arch: str, num_classes: int, kwargs: dict) -> nn.Module:
    """torchvision's (or timm's) model, random weights."""
    if _is_timm(arch):
        return timmarch.create(arch, num_classes, kwargs)
    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)


@functools.lru_cache(maxsize=256)
def _meta_model(arch: str, kwargs: tuple, num_classes: int = 1000) -> nn.Module:
    if _is_timm(arch):
        return timmarch.create(arch, num_classes, dict(kwargs), meta=True)

    def build():
        return torchvision.models.get_model(arch, weights=None, num_classes=num_classes,
                                            **dict(kwargs))
    with torch.random.fork_rng(devices=[]):  # a probe draws nothing from the run's generator
        try:
            with torch.device("meta"):
                return build()
        except NotImplementedError:  # a builder computing on tensors (RegNet's widths): on CPU
            return build().to("meta")


@functools.cache
def head_keys(arch: str) -> frozenset:
    """The state_dict keys of the classifier head of `arch`: those whose shape follows the
    number of classes (found by building it for 1000 and 1001 classes)."""
    kw = tuple(_kwargs(ModelSpec("", arch)).items())
    a = _meta_model(arch, kw, 1000).state_dict()
    b = _meta_model(arch, kw, 1001).state_dict()
    keys = frozenset(k for k in a if a[k].shape != b[k].shape)
    assert keys, f"no tensor of {arch} follows the number of classes"
    return keys


def fits_image_size(arch: str, size: int, spec: ModelSpec | None = None) -> str | None:
    """None when `arch` takes `size` x `size` images; else the reason (the forward's error)."""
    kw = tuple(_kwargs(spec or ModelSpec("", arch), size).items())
    try:  # a model built per size (ViT) may refuse it in its constructor
        model = _meta_model(arch, kw).eval()
        with torch.no_grad():
            out = model(torch.empty(2, 3, size, size, device="meta"))
    except (RuntimeError, ValueError, AssertionError, IndexError) as e:
        return str(e).split("\n")[0]
    return None if tuple(out.shape) == (2, 1000) else f"output of shape {tuple(out.shape)}"


def check_image_size(spec: ModelSpec, size: int) -> None:
    """Raise ImageSizeError when `spec`'s model cannot take `size` x `size` images."""
    why = fits_image_size(spec.arch, size, spec)
    if why is None:
        return
    fits = SIZES.get(spec.arch, ())
    raise ImageSizeError(
        f"{spec.arch} cannot take --image-size {size} ({why}). Sizes it takes include "
        f"{', '.join(map(str, fits)) or 'none of the probed ones'}: pick one of them.")


def _check_backbone(state: dict, spec: ModelSpec, source: str) -> None:
    """The state_dict must fit the architecture except for the classifier head."""
    ref = _meta_model(spec.arch, tuple(_kwargs(spec).items())).state_dict()
    head = head_keys(spec.arch)
    want = {k: v.shape for k, v in ref.items() if k not in head}
    missing = [k for k in want if k not in state]
    wrong = [k for k in want if k in state and tuple(state[k].shape) != tuple(want[k])
             and not k.endswith("pos_embedding")]  # resized to the image size on loading
    if missing or wrong:
        raise InvalidModelDirectoryError(
            f"{source} does not fit {spec.arch}: {len(missing)} missing and {len(wrong)} "
            f"mis-shaped tensors (first: {(missing + wrong)[0]}). Give a state_dict saved from a "
            f"{'' if _is_timm(spec.arch) else 'torchvision '}{spec.arch}."
        )


def load_state_dict_file(path) -> dict:
    """A state_dict saved with torch.save, loaded safely (weights_only: no code runs)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad file; keep the cause
        raise InvalidModelDirectoryError(
            f"{path} is not a loadable state_dict ({type(e).__name__}: {e}). Save weights with "
            "torch.save(model.state_dict(), path)."
        ) from e
    if isinstance(state, dict) and "state_dict" in state:  # common checkpoint wrapper
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise InvalidModelDirectoryError(f"{path} does not hold a state_dict of tensors.")
    return {k.removeprefix("module."): v for k, v in state.items()}


def _pretrained_state(arch: str) -> dict:
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    try:
        return weights.get_state_dict(progress=False)
    except OSError as e:  # URLError is an OSError: no network and no cached file
        hub = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
        raise InvalidModelDirectoryError(
            f"could not get the ImageNet weights of {arch} ({e}). They are downloaded from "
            f"{weights.url} into {hub}: allow network access, copy that file there by hand, or "
            "pass --weights FILE with a local state_dict instead."
        ) from e


def write_untrained_model(out, arch: str, *, pretrained: bool = False, weights=None,
                          **family) -> ModelSpec:
    """Write an untrained model directory; weights (pretrained or from a file) are stored in it,
    so training never needs the network. `family`: ModelOptions' options (trainer/model/spec.py).

    Raises:
        InvalidParameterError: an unknown name, or both pretrained and weights.
        FamilyOptionError: an option `arch`'s family does not take.
    """
    if pretrained and weights:
        raise InvalidParameterError("give either --pretrained or --weights FILE, not both.")
    version = timmarch.installed_version() if _is_timm(arch) else None
    spec = model_spec(arch, pretrained=pretrained, timm=version,
                      weights=WEIGHTS_FILE if (pretrained or weights) else None, **family)
    if version:
        timmarch.model_name(arch)  # a name timm knows, before anything is written
    state = None
    if pretrained:
        state = (timmarch.pretrained_state(arch) if version else _pretrained_state(arch))
    elif weights:
        state = load_state_dict_file(weights)
        _check_backbone(state, spec, str(weights))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if state is not None:
        # to a file, not a path: torch's zip writer then raises on a full disk, it does not abort
        atomic_write(out / WEIGHTS_FILE, lambda f: torch.save(state, f))
    atomic_write_bytes(out / SPEC_FILE, (json.dumps(spec.to_json(), indent=1) + "\n").encode())
    return spec


def _fit_position_embedding(state: dict, model: nn.Module, image_size: int) -> dict:
    """ViT weights of another image size: torchvision's interpolation of the embedding."""
    key = "encoder.pos_embedding"
    if key not in state or state[key].shape == model.state_dict()[key].shape:
        return state
    from torchvision.models.vision_transformer import interpolate_embeddings

    return interpolate_embeddings(image_size, model.patch_size, state)


def build_model(spec: ModelSpec, num_classes: int, model_dir=None,
                image_size: int | None = None) -> nn.Module:
    """The torchvision model with a fresh `num_classes` head, backbone weights loaded if any.
    `image_size`: the training size, for the families built per size (ViT)."""
    if _is_timm(spec.arch):
        timmarch.check_version(spec.timm, spec.arch)
    model = _build(spec.arch, num_classes, _kwargs(spec, image_size))
    if spec.weights:
        path = Path(model_dir) / spec.weights
        state = load_state_dict_file(path)
        _check_backbone(state, spec, str(path))
        head = head_keys(spec.arch)
        state = {k: v for k, v in state.items() if k not in head}
        state = _fit_position_embedding(state, model, image_size or 224)
        own = model.state_dict()  # aux heads a file may carry are not part of ours
        load_into(model, {k: v for k, v in state.items() if k in own}, strict=False)
    return model


def load_into(model: nn.Module, state: dict, strict: bool = True):
    """model.load_state_dict(state), with the model's own module versions where `state` has
    none (a plain dict of tensors: MNASNet refuses a state_dict without its version)."""
    if getattr(state, "_metadata", None) is None:
        state = collections.OrderedDict(state)
        state._metadata = model.state_dict()._metadata
    return model.load_state_dict(state, strict=strict)
