"""A model directory a user's own training script wrote: the network in one file, its class names
beside it. `kfvision score`, `serve`, `export`, `register` and `deploy` take it as they take a
directory `kfvision train` wrote (docs/scripts.md has the layout for script authors).

    MODEL_DIR/
      model.pt2      torch.export.save(torch.export.export(model, (x,), ...), path)  \\
      model.pt       torch.jit.save(torch.jit.script(model), path)                   } one of them
      model.onnx     torch.onnx.export(model, (x,), path, dynamo=True, ...)          /
                     (with model.onnx.data beside it, unless external_data=False)
      classes.txt    one class name per line, in the order of the model's outputs
      kfvision.json  optional: {"classes", "image_size", "mean", "std", "eval_preset", "output",
                     "model"} (KEYS)

The network is the one the script trained, called as it was trained: float32 [batch, 3, S, S]
RGB scaled to 0-1 and normalised by mean/std in, [batch, classes] logits out (or probabilities,
with "output": "probabilities"). Where a script wrote several files, "model" in kfvision.json
names the one to use, else the first of MODEL_FILES. The input size is kfvision.json's
"image_size", else the file's own fixed input size (ONNX, torch.export), else 224.

This module reads and checks the layout, without torch (`kfvision push` checks a directory
with it); trainer/model/scriptnet.py loads the network.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from kfvision.trainer.errors import InvalidModelDirectoryError
from kfvision.trainer.presets import AUGMENTATIONS, IMAGENET_MEAN, IMAGENET_STD

# file name -> format; also the precedence where a directory holds several
MODEL_FILES = {"model.pt2": "torch-export", "model.pt": "torchscript", "model.onnx": "onnx"}
SUFFIXES = {".pt2": "torch-export", ".pt": "torchscript", ".onnx": "onnx"}
CLASSES_FILE = "classes.txt"
META_FILE = "kfvision.json"
FORMAT = "kfvision.script-model"  # info["format"] of a loaded script model
DEFAULT_IMAGE_SIZE = 224
OUTPUTS = ("logits", "probabilities")
KEYS = ("classes", "image_size", "mean", "std", "eval_preset", "output", "model")
# How a script writes each format: what an error about a missing or wrong file shows.
BATCH = 'dynamic_shapes=({0: torch.export.Dim("batch")},)'  # any batch size, not the example's
SNIPPETS = {
    "torch-export": "torch.export.save(torch.export.export(model.eval(), (torch.randn(2, 3, 224, "
                    f'224),), {BATCH}), f"{{model_dir}}/model.pt2")',
    "torchscript": 'torch.jit.save(torch.jit.script(model.eval()), f"{model_dir}/model.pt")',
    "onnx": 'torch.onnx.export(model.eval(), (torch.randn(2, 3, 224, 224),), '
            f'f"{{model_dir}}/model.onnx", dynamo=True, {BATCH})',
}
CLASSES_SNIPPET = ('open(f"{model_dir}/classes.txt", "w").write("\\n".join(class_names) + "\\n")'
                   "  # in output order")


def how_to_write() -> str:
    """The lines a script adds to write a model directory kfvision serves: one of the three
    formats, and the class names."""
    return "\n".join(["    " + SNIPPETS["torch-export"],
                      "    # or: " + SNIPPETS["torchscript"],
                      "    # or: " + SNIPPETS["onnx"],
                      "    " + CLASSES_SNIPPET,
                      "(docs/scripts.md)"])


@dataclass(frozen=True)
class ScriptModel:
    """The validated layout of a script's model directory (the network not loaded yet)."""

    path: Path  # the model file
    format: str  # one of MODEL_FILES' values
    classes: tuple
    image_size: int | None  # None: the file's own input size, else DEFAULT_IMAGE_SIZE
    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD
    eval_preset: str = AUGMENTATIONS[0]  # "standard": torchvision's ImageNet evaluation resize
    output: str = OUTPUTS[0]

    def info(self, image_size: int) -> dict:
        """What scoring and serving read (the keys of a trained model's model.json they use)."""
        return {"format": FORMAT, "model_format": self.format, "model_file": self.path.name,
                "classes": list(self.classes), "image_size": image_size,
                "eval_preset": self.eval_preset, "mean": list(self.mean), "std": list(self.std),
                "output": self.output}


def has_script_model(model_dir) -> bool:
    """Whether `model_dir` holds one of MODEL_FILES or a kfvision.json (a script's layout)."""
    d = Path(model_dir)
    return any((d / name).is_file() for name in (*MODEL_FILES, META_FILE))


def bad(where, problem: str) -> InvalidModelDirectoryError:
    return InvalidModelDirectoryError(f"{where} {problem}")


def _read_meta(model_dir: Path) -> dict:
    path = model_dir / META_FILE
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise bad(path, f"is not JSON ({e}); write e.g. {{\"image_size\": 224}}") from e
    if not isinstance(meta, dict):
        raise bad(path, f"must hold a JSON object, not {type(meta).__name__}")
    unknown = sorted(set(meta) - set(KEYS))
    if unknown:
        raise bad(path, f"has unknown key(s) {', '.join(unknown)}; the keys it may hold: "
                   f"{', '.join(KEYS)}")
    return meta


def _classes(model_dir: Path, meta: dict) -> tuple:
    path = model_dir / CLASSES_FILE
    from_file = None
    if path.is_file():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise bad(path, f"cannot be read as UTF-8 text ({e})") from e
        while lines and not lines[-1].strip():
            lines.pop()
        empty = [i + 1 for i, line in enumerate(lines) if not line.strip()]
        if empty:
            raise bad(path, f"has an empty line (line {empty[0]}): write one class name per "
                       "line, none empty")
        from_file = tuple(line.strip() for line in lines)
    given = meta.get("classes")
    if given is not None and (not isinstance(given, list)
                              or not all(isinstance(c, str) and c.strip() for c in given)):
        raise bad(model_dir / META_FILE, "'classes' must be a list of non-empty strings")
    if from_file is not None and given is not None and list(from_file) != given:
        raise bad(model_dir, f"has two different class lists: {CLASSES_FILE} {list(from_file)} "
                   f"and {META_FILE} {given}; keep one of them")
    classes = from_file if from_file is not None else tuple(given or ())
    if not classes:
        where = f"{path} is empty" if from_file is not None else \
            f"{model_dir} has no {CLASSES_FILE}"
        raise InvalidModelDirectoryError(
            f"{where}: kfvision needs the class names, one per line in the order of the model's "
            f"outputs. Add to your script:\n    {CLASSES_SNIPPET}")
    dupes = sorted({c for c in classes if classes.count(c) > 1})
    if dupes:
        raise bad(model_dir, f"lists class(es) {dupes} more than once; class names must differ")
    return classes


def _model_file(model_dir: Path, meta: dict) -> tuple[Path, str]:
    named = meta.get("model")
    if named is not None:
        if not isinstance(named, str) or Path(named).name != named:
            raise bad(model_dir / META_FILE, f"'model' = {named!r} must be a file name in "
                       f"{model_dir} (no folders)")
        fmt = SUFFIXES.get(Path(named).suffix)
        if fmt is None:
            raise bad(model_dir / META_FILE, f"'model' = {named!r} has a suffix kfvision does "
                       f"not load; name a {', '.join(SUFFIXES)} file")
        if not (model_dir / named).is_file():
            raise bad(model_dir / META_FILE, f"names 'model' = {named!r}, which is not in "
                       f"{model_dir}")
        return model_dir / named, fmt
    for name, fmt in MODEL_FILES.items():
        if (model_dir / name).is_file():
            return model_dir / name, fmt
    raise InvalidModelDirectoryError(no_model(model_dir))


def no_model(model_dir: Path) -> str:
    """Why `model_dir` is no model directory at all, what it holds, and what to write."""
    if not model_dir.is_dir():
        return (f"{model_dir} is not a trained model directory, nor one a training script wrote: "
                f"it {'is a file' if model_dir.exists() else 'does not exist'}. Give the folder "
                "`kfvision train --out` or your script wrote.")
    others = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    if "spec.json" in others:  # `kfvision model`'s output, given where its training's belongs
        return (f"{model_dir} is not a trained model directory but an untrained one (spec.json, "
                f"as `kfvision model` writes it). Train it first: `kfvision train --model "
                f"{model_dir} --train TRAIN --val VAL --out OUT`, then give OUT.")
    found = (f"it holds {', '.join(others[:8])}{' ...' if len(others) > 8 else ''}" if others
             else "it is empty")
    return (f"{model_dir} is not a trained model directory (model.json and weights.pt, which "
            f"`kfvision train --out {model_dir}` writes), nor one a training script wrote "
            f"({', '.join(MODEL_FILES)} with {CLASSES_FILE}): {found}. A state_dict or a pickled "
            "module (torch.save) cannot be loaded without your code. Add to your script:\n"
            + how_to_write())


def _numbers(meta: dict, key: str, default: tuple, where: Path) -> tuple:
    value = meta.get(key, list(default))
    if (not isinstance(value, list) or len(value) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        raise bad(where, f"'{key}' = {value!r} must be 3 numbers, one per RGB channel (e.g. "
                   f"{list(default)})")
    if key == "std" and min(value) <= 0:
        raise bad(where, f"'std' = {value!r} must be positive")
    return tuple(float(v) for v in value)


def read_script_model(model_dir) -> ScriptModel:
    """The layout of a script's model directory, validated; the network is not loaded.

    Raises:
        InvalidModelDirectoryError: saying which file is missing or wrong and what to write.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise InvalidModelDirectoryError(no_model(model_dir))
    meta = _read_meta(model_dir)
    path, fmt = _model_file(model_dir, meta)
    classes = _classes(model_dir, meta)
    where = model_dir / META_FILE
    size = meta.get("image_size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool)
                             or not 8 <= size <= 4096):
        raise bad(where, f"'image_size' = {size!r} must be a whole number of pixels, 8 to 4096")
    for key, choices in (("eval_preset", AUGMENTATIONS), ("output", OUTPUTS)):
        if meta.get(key, choices[0]) not in choices:
            raise bad(where, f"'{key}' = {meta[key]!r} is not valid; choose one of: "
                      f"{', '.join(choices)}")
    preset, output = meta.get("eval_preset", AUGMENTATIONS[0]), meta.get("output", OUTPUTS[0])
    return ScriptModel(path, fmt, classes, size, _numbers(meta, "mean", IMAGENET_MEAN, where),
                       _numbers(meta, "std", IMAGENET_STD, where), preset, output)
