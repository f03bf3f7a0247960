"""Which kind of model directory a folder is, its files checked without torch: one `kfvision train`
wrote (trainer/model/trained.py) or one a user's training script wrote (trainer/model/scripted.py).

`kfvision score`, `serve` and `export` call `model_kind` before they import torch, so a wrong
`--model` is said at once (0.1 s) with the same words the loader would use after 2.5 s of imports;
`load_model` reads through the same functions, so the two cannot disagree.
"""

import json
from pathlib import Path

from kfvision.trainer.errors import InvalidModelDirectoryError
from kfvision.trainer.model.scripted import has_script_model, no_model, read_script_model
from kfvision.trainer.model.spec import WEIGHTS_FILE, ModelSpec, read_model_spec

MODEL_FILE = "model.json"
MODEL_FORMAT = "kfvision.trained-model"
TRAINED = "trained"  # model_kind of a directory `kfvision train` wrote


def is_trained_model(model_dir) -> bool:
    """Whether `model_dir` is one `kfvision train` wrote (model.json and weights.pt), not a
    script's."""
    model_dir = Path(model_dir)
    return (model_dir / MODEL_FILE).is_file() and (model_dir / WEIGHTS_FILE).is_file()


def read_trained_model(model_dir) -> tuple[dict, ModelSpec]:
    """(model.json contents, the architecture spec) of a trained model directory, checked; the
    weights are not read.

    Raises:
        InvalidModelDirectoryError: a script's directory, a broken one, or no model at all, saying
            which file is missing and what to give instead.
    """
    model_dir = Path(model_dir)
    path = model_dir / MODEL_FILE
    if not is_trained_model(model_dir) and has_script_model(model_dir):
        raise InvalidModelDirectoryError(
            f"{model_dir} holds a model a training script wrote (TorchScript, torch.export or "
            "ONNX); this needs a directory `kfvision train` wrote (model.json and "
            f"{WEIGHTS_FILE}). Score, serve, export or register the script's directory instead.")
    if path.is_file() != (model_dir / WEIGHTS_FILE).is_file():  # one of them: a broken one
        raise InvalidModelDirectoryError(
            f"{model_dir} is not a trained model directory (needs {MODEL_FILE} and "
            f"{WEIGHTS_FILE}). Train one with `kfvision train --out {model_dir} ...`."
        )
    if not path.is_file():  # neither kind: say what either needs
        raise InvalidModelDirectoryError(no_model(model_dir))
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(info, dict) or info.get("format") != MODEL_FORMAT:
            raise ValueError(f"format is not {MODEL_FORMAT!r}")
        if not isinstance(info["classes"], list) or not info["classes"]:
            raise ValueError("'classes' is not a list of class names")
    except (OSError, UnicodeDecodeError, ValueError, KeyError) as e:
        raise InvalidModelDirectoryError(f"{path}, the trained model directory's model.json, "
                                         f"is malformed ({e}).") from e
    return info, read_model_spec(model_dir)


def model_kind(model_dir) -> str:
    """TRAINED for a directory `kfvision train` wrote, else the format of the network a script
    wrote ("torch-export", "torchscript" or "onnx"), the directory's files checked as the loader
    checks them.

    Raises:
        InvalidModelDirectoryError: neither kind, or a broken one, saying which file is missing or
            wrong and what to write.
    """
    if not has_script_model(model_dir) or is_trained_model(model_dir):
        read_trained_model(model_dir)
        return TRAINED
    return read_script_model(model_dir).format
