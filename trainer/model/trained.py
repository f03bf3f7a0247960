"""The trained model directory: everything scoring and export need, and nothing else.

    weights.pt     state_dict of the trained model (torch.load(..., weights_only=True))
    spec.json      the architecture spec (so this folder also works as an untrained model for
                   fine-tuning: its weights become the backbone, the head is re-sized)
    model.json     classes, input size, eval preprocessing and normalisation
    config.yaml    the resolved training configuration and world size
    metrics.json   per-epoch history and final figures

`load_model` also takes the model directory a user's own training script wrote (the network as
TorchScript, torch.export or ONNX, and its class names: trainer/model/scripted.py, scriptnet.py),
so scoring, serving and export read either kind through one function. Which kind a folder is, and
whether its files are complete, is read without torch in trainer/model/layout.py.
"""

import dataclasses
import json
from pathlib import Path

import torch

from kfvision.trainer.errors import InvalidModelDirectoryError
from kfvision.trainer.fileio import atomic_write, atomic_write_bytes, atomic_write_json
from kfvision.trainer.model.arch import build_model, load_into
from kfvision.trainer.model.layout import (
    MODEL_FILE,
    MODEL_FORMAT,
    is_trained_model,
    read_trained_model,
)
from kfvision.trainer.model.scripted import has_script_model
from kfvision.trainer.model.scriptnet import load_script_model
from kfvision.trainer.model.spec import SPEC_FILE, WEIGHTS_FILE, ModelSpec
from kfvision.trainer.model.timmarch import mismatch_hint as timm_mismatch_hint


def atomic_torch_save(obj, path) -> None:
    """torch.save atomically, streamed to the file (no copy in memory: checkpoints are big)."""
    atomic_write(path, lambda f: torch.save(obj, f))


def write_model_files(out, spec: ModelSpec, info: dict, config: dict) -> None:
    """Write spec.json, model.json and config.yaml (weights and metrics follow as they come)."""
    out = Path(out)
    trained_spec = dataclasses.replace(spec, pretrained=False, weights=WEIGHTS_FILE)
    atomic_write_json(out / SPEC_FILE, trained_spec.to_json())
    atomic_write_json(out / MODEL_FILE, {"format": MODEL_FORMAT, "version": 1, **info})
    atomic_write_bytes(out / "config.yaml", _yaml_text(config).encode())


def _yaml_text(config: dict) -> str:
    try:
        import yaml
    except ImportError:  # the GPU images have torch but not PyYAML; JSON is valid YAML too
        return json.dumps(config, indent=2) + "\n"
    return yaml.safe_dump(config, sort_keys=False)


def load_model(model_dir, *, device: str = "cpu", threads: int | None = None):
    """(network: normalised float batch -> [batch, classes] logits, in eval mode on `device`;
    info: classes, image_size, eval_preset, mean, std, format) of any model directory kfvision
    scores and serves: one `kfvision train` wrote, or one a script wrote (`load_script_model`;
    `threads`: its ONNX runtime's).

    Raises:
        InvalidModelDirectoryError: neither kind, saying which file is missing and what to write.
    """
    if not has_script_model(model_dir) or is_trained_model(model_dir):
        model, info = load_trained_model(model_dir)
        return model.to(torch.device(device)), info
    return load_script_model(model_dir, device=device, threads=threads)


def load_trained_model(model_dir) -> tuple[torch.nn.Module, dict]:
    """(model in eval mode on CPU, model.json contents) of a trained model directory (its files
    checked by trainer/model/layout.py `read_trained_model`)."""
    model_dir = Path(model_dir)
    info, spec = read_trained_model(model_dir)
    classes = info["classes"]
    model = build_model(dataclasses.replace(spec, weights=None), len(classes),
                        image_size=info.get("image_size"))
    state = torch.load(model_dir / WEIGHTS_FILE, map_location="cpu", weights_only=True)
    try:
        load_into(model, state)
    except RuntimeError as e:
        hint = timm_mismatch_hint(spec.timm) if spec.timm else ""
        raise InvalidModelDirectoryError(
            f"{model_dir / WEIGHTS_FILE} does not match {spec.arch} with {len(classes)} classes: "
            f"{e}{hint}"
        ) from e
    return model.eval(), info
