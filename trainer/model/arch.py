"""Model registry: the torchvision model an untrained-model directory describes (its
`spec.json`, trainer/model/spec.py, and an optional `weights.pt`), and writing such a directory.

The architectures are the ones Azure ML designer's ResNet and DenseNet modules offer, built by
torchvision. The classifier head is sized to the training data's classes at training time.
"""

import json
from pathlib import Path

import torch
import torchvision
from torch import nn

from kfvision.trainer.errors import InvalidModelDirectoryError, InvalidParameterError
from kfvision.trainer.fileio import atomic_write, atomic_write_bytes
from kfvision.trainer.model.spec import SPEC_FILE, WEIGHTS_FILE, ModelSpec
from kfvision.trainer.presets import family_of


def _head_prefix(family: str) -> str:
    return "fc." if family == "resnet" else "classifier."


def _torchvision_kwargs(spec: ModelSpec) -> dict:
    if spec.family == "resnet":
        return {"zero_init_residual": spec.zero_init_residual}
    return {"memory_efficient": spec.memory_efficient}


def _check_backbone(state: dict, spec: ModelSpec, source: str) -> None:
    """The state_dict must fit the architecture except for the classifier head."""
    ref = torchvision.models.get_model(spec.arch, weights=None, **_torchvision_kwargs(spec))
    want = {k: v.shape for k, v in ref.state_dict().items()
            if not k.startswith(_head_prefix(spec.family))}
    missing = [k for k in want if k not in state]
    wrong = [k for k in want if k in state and tuple(state[k].shape) != tuple(want[k])]
    if missing or wrong:
        raise InvalidModelDirectoryError(
            f"{source} does not fit {spec.arch}: {len(missing)} missing and {len(wrong)} "
            f"mis-shaped tensors (first: {(missing + wrong)[0]}). Give a state_dict saved from a "
            f"torchvision {spec.arch}."
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
                          zero_init_residual: bool = False,
                          memory_efficient: bool = False) -> ModelSpec:
    """Write an untrained model directory; weights (pretrained or from a file) are stored in it,
    so training never needs the network.
    """
    family = family_of(arch)
    if pretrained and weights:
        raise InvalidParameterError("give either --pretrained or --weights FILE, not both.")
    spec = ModelSpec(family, arch, pretrained, WEIGHTS_FILE if (pretrained or weights) else None,
                     zero_init_residual and family == "resnet",
                     memory_efficient and family == "densenet")
    state = None
    if pretrained:
        state = _pretrained_state(arch)
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


def build_model(spec: ModelSpec, num_classes: int, model_dir=None) -> nn.Module:
    """The torchvision model with a fresh `num_classes` head, backbone weights loaded if any."""
    model = torchvision.models.get_model(spec.arch, weights=None, num_classes=num_classes,
                                         **_torchvision_kwargs(spec))
    if spec.weights:
        path = Path(model_dir) / spec.weights
        state = load_state_dict_file(path)
        _check_backbone(state, spec, str(path))
        head = _head_prefix(spec.family)
        model.load_state_dict({k: v for k, v in state.items() if not k.startswith(head)},
                              strict=False)
    return model

