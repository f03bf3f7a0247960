"""A model directory a user's own training script wrote: the network in one file, its class names
beside it. `kfvision score`, `serve`, `export`, `register` and `deploy` take it as they take a
directory `kfvision train` wrote (docs/scripts.md has the layout for script authors).

    MODEL_DIR/
      model.pt2      torch.export.save(torch.export.export(model, (x,)), path)   \\
      model.pt       torch.jit.save(torch.jit.script(model), path)               } one of them
      model.onnx     torch.onnx.export(model, (x,), path, dynamo=True)           /
      classes.txt    one class name per line, in the order of the model's outputs
      kfvision.json  optional: {"classes", "image_size", "mean", "std", "eval_preset", "output",
                     "model"} (KEYS)

The network is the one the script trained, called as it was trained: float32 [batch, 3, S, S]
RGB scaled to 0-1 and normalised by mean/std in, [batch, classes] logits out (or probabilities,
with "output": "probabilities"). Where a script wrote several files, "model" in kfvision.json
names the one to use, else the first of MODEL_FILES. The input size is kfvision.json's
"image_size", else the file's own fixed input size (ONNX, torch.export), else 224.

onnxruntime is imported only to load an ONNX model.
"""

import json
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainer.errors import DeviceError, InvalidModelDirectoryError, check_choice, check_range
from trainer.presets import AUGMENTATIONS, IMAGENET_MEAN, IMAGENET_STD

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
SNIPPETS = {
    "torch-export": 'torch.export.save(torch.export.export(model.eval(), (torch.randn(1, 3, 224, '
                    '224),)), f"{model_dir}/model.pt2")',
    "torchscript": 'torch.jit.save(torch.jit.script(model.eval()), f"{model_dir}/model.pt")',
    "onnx": 'torch.onnx.export(model.eval(), (torch.randn(1, 3, 224, 224),), '
            'f"{model_dir}/model.onnx", dynamo=True)',
}
CLASSES_SNIPPET = ('open(f"{model_dir}/classes.txt", "w").write("\\n".join(class_names) + "\\n")'
                   "  # in output order")


def how_to_write() -> str:
    """The lines a script adds to write a model directory kfvision serves."""
    return "\n".join(["    " + SNIPPETS["torchscript"] + "   # or model.pt2 / model.onnx:",
                      "    " + SNIPPETS["torch-export"],
                      "    " + SNIPPETS["onnx"],
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
    eval_preset: str = "standard"
    output: str = "logits"

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


def _bad(where, problem: str) -> InvalidModelDirectoryError:
    return InvalidModelDirectoryError(f"{where} {problem}")


def _read_meta(model_dir: Path) -> dict:
    path = model_dir / META_FILE
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _bad(path, f"is not JSON ({e}); write e.g. {{\"image_size\": 224}}") from e
    if not isinstance(meta, dict):
        raise _bad(path, f"must hold a JSON object, not {type(meta).__name__}")
    unknown = sorted(set(meta) - set(KEYS))
    if unknown:
        raise _bad(path, f"has unknown key(s) {', '.join(unknown)}; the keys it may hold: "
                   f"{', '.join(KEYS)}")
    return meta


def _classes(model_dir: Path, meta: dict) -> tuple:
    path = model_dir / CLASSES_FILE
    from_file = None
    if path.is_file():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise _bad(path, f"cannot be read as UTF-8 text ({e})") from e
        while lines and not lines[-1].strip():
            lines.pop()
        empty = [i + 1 for i, line in enumerate(lines) if not line.strip()]
        if empty:
            raise _bad(path, f"has an empty line (line {empty[0]}): write one class name per "
                       "line, none empty")
        from_file = tuple(line.strip() for line in lines)
    given = meta.get("classes")
    if given is not None and (not isinstance(given, list)
                              or not all(isinstance(c, str) and c.strip() for c in given)):
        raise _bad(model_dir / META_FILE, "'classes' must be a list of non-empty strings")
    if from_file is not None and given is not None and list(from_file) != given:
        raise _bad(model_dir, f"has two different class lists: {CLASSES_FILE} {list(from_file)} "
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
        raise _bad(model_dir, f"lists class(es) {dupes} more than once; class names must differ")
    return classes


def _model_file(model_dir: Path, meta: dict) -> tuple[Path, str]:
    named = meta.get("model")
    if named is not None:
        if not isinstance(named, str) or Path(named).name != named:
            raise _bad(model_dir / META_FILE, f"'model' = {named!r} must be a file name in "
                       f"{model_dir} (no folders)")
        fmt = SUFFIXES.get(Path(named).suffix)
        if fmt is None:
            raise _bad(model_dir / META_FILE, f"'model' = {named!r} has a suffix kfvision does "
                       f"not load; name a {', '.join(SUFFIXES)} file")
        if not (model_dir / named).is_file():
            raise _bad(model_dir / META_FILE, f"names 'model' = {named!r}, which is not in "
                       f"{model_dir}")
        return model_dir / named, fmt
    for name, fmt in MODEL_FILES.items():
        if (model_dir / name).is_file():
            return model_dir / name, fmt
    others = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    found = (f"it holds {', '.join(others[:8])}{' ...' if len(others) > 8 else ''}" if others
             else "it is empty")
    raise InvalidModelDirectoryError(
        f"{model_dir} holds no model kfvision can load ({found}). kfvision reads "
        f"{', '.join(MODEL_FILES)} (torch.export, TorchScript, ONNX) with {CLASSES_FILE} beside "
        "it, or a directory `kfvision train` wrote (model.json and weights.pt). A state_dict or a "
        "pickled module (torch.save) cannot be loaded without your code. Add to your script:\n"
        + how_to_write())


def _numbers(meta: dict, key: str, default: tuple, where: Path) -> tuple:
    value = meta.get(key, list(default))
    if (not isinstance(value, list) or len(value) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        raise _bad(where, f"'{key}' = {value!r} must be 3 numbers, one per RGB channel (e.g. "
                   f"{list(default)})")
    if key == "std" and min(value) <= 0:
        raise _bad(where, f"'std' = {value!r} must be positive")
    return tuple(float(v) for v in value)


def read_script_model(model_dir) -> ScriptModel:
    """The layout of a script's model directory, validated; the network is not loaded.

    Raises:
        InvalidModelDirectoryError: saying which file is missing or wrong and what to write.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        what = "a file" if model_dir.exists() else "not there"
        raise InvalidModelDirectoryError(
            f"{model_dir} is not a model directory (it is {what}): give the folder `kfvision "
            "train` or your training script wrote")
    meta = _read_meta(model_dir)
    path, fmt = _model_file(model_dir, meta)
    classes = _classes(model_dir, meta)
    where = model_dir / META_FILE
    size = meta.get("image_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool):
            raise _bad(where, f"'image_size' = {size!r} must be a whole number of pixels")
        check_range(f"{where}: image_size", size, 8, 4096)
    preset = meta.get("eval_preset", "standard")
    check_choice(f"{where}: eval_preset", preset, AUGMENTATIONS)
    output = meta.get("output", "logits")
    check_choice(f"{where}: output", output, OUTPUTS)
    return ScriptModel(path, fmt, classes, size, _numbers(meta, "mean", IMAGENET_MEAN, where),
                       _numbers(meta, "std", IMAGENET_STD, where), preset, output)


def _zip_names(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as z:
            return z.namelist()
    except (OSError, zipfile.BadZipFile):
        return []


def _not_what_it_says(path: Path, fmt: str) -> str:
    """Why a .pt/.pt2 file did not load, from what its zip archive holds."""
    names = _zip_names(path)
    if any(n.endswith("/archive_format") or n == "archive_format" for n in names):
        what = "a torch.export program (torch.export.save): name it model.pt2"
    elif any(n.endswith("/constants.pkl") for n in names):
        what = "a TorchScript archive (torch.jit.save): name it model.pt"
    elif any(n.endswith("/data.pkl") for n in names):
        what = ("torch.save's pickle (a state_dict or a whole module), which needs your code to "
                "load")
    else:
        what = "not a file PyTorch wrote, or a damaged one"
    return f"is not {'TorchScript' if fmt == 'torchscript' else 'a torch.export program'}: it is " \
           f"{what}. Write it with\n    {SNIPPETS[fmt]}"


def _fixed_shape(shape) -> tuple:
    """(batch, height, width) of an input shape, each an int where fixed, else None."""
    dims = [d if isinstance(d, int) and not isinstance(d, bool) else None for d in shape]
    return tuple(dims) if len(dims) != 4 else (dims[0], dims[2], dims[3])


def _load_torchscript(path: Path, device: str):

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # TorchScript is deprecated, not gone
            return torch.jit.load(str(path), map_location=device), (None, None, None)
    except RuntimeError as e:
        raise _bad(path, _not_what_it_says(path, "torchscript")) from e


def _load_torch_export(path: Path, device: str):

    try:
        with open(path, "rb") as f:  # a file object: any name works, not only *.pt2
            program = torch.export.load(f)
    except (RuntimeError, ValueError, KeyError) as e:
        raise _bad(path, _not_what_it_says(path, "torch-export")) from e
    inputs = [n for n in program.graph.nodes
              if n.op == "placeholder" and n.name in program.graph_signature.user_inputs]
    if len(inputs) != 1:
        raise _bad(path, f"takes {len(inputs)} inputs; kfvision gives one, the image batch")
    shape = getattr(inputs[0].meta.get("val"), "shape", ())
    return program.module().to(device), _fixed_shape(shape)


class OnnxNet(nn.Module):
    """An ONNX classifier on onnxruntime's CPU provider, called like a module: float32 batch ->
    output tensor. Its threads do not spin while idle (a server decodes images on the same cores);
    `InferenceSession.run` is thread-safe."""

    def __init__(self, path: Path, threads: int | None):
        import onnxruntime as ort

        super().__init__()
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = ort.InferenceSession(str(path), opts,
                                                providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own types for a bad or foreign file
            raise _bad(path, f"is not an ONNX model onnxruntime can load ({type(e).__name__}: "
                       f"{str(e)[:300]}). Write it with\n    {SNIPPETS['onnx']}") from e
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise _bad(path, f"takes {len(inputs)} inputs; kfvision gives one, the image batch")
        if inputs[0].type != "tensor(float)":
            raise _bad(path, f"takes {inputs[0].type}; kfvision gives float32 images, normalised "
                       "(a `kfvision export` file takes uint8: serve that file itself)")
        self.input, self.shape = inputs[0].name, _fixed_shape(inputs[0].shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.session.run(None, {self.input: x.contiguous().numpy()})[0]
        return torch.from_numpy(out)


class ScriptNet(nn.Module):
    """A script's network as kfvision calls every model: normalised float batch of any size ->
    [batch, classes] logits. A network with a fixed batch size is run on slices of it (the last
    one padded); one that outputs probabilities gives their logarithm, whose softmax is them."""

    def __init__(self, net: nn.Module, batch: int | None, probabilities: bool):
        super().__init__()
        self.net, self.batch, self.probabilities = net, batch, probabilities

    def train(self, mode: bool = True) -> "ScriptNet":
        # Inference only, and a torch.export module refuses train()/eval(): the graph keeps the
        # mode it was exported in. So the switch stops here rather than reach the network.
        self.training = mode
        return self

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch is None or len(x) == self.batch:
            return self.net(x)
        outs = []
        for start in range(0, len(x), self.batch):
            part = x[start:start + self.batch]
            n = len(part)
            if n < self.batch:  # repeat the last image up to the fixed size, keep n outputs
                part = torch.cat([part, part[-1:].expand(self.batch - n, *part.shape[1:])])
            outs.append(self.net(part)[:n])
        return torch.cat(outs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._forward(x)
        return out.log() if self.probabilities else out


def _image_size(spec: ScriptModel, height, width) -> int:
    if height is not None and width is not None and height != width:
        raise _bad(spec.path, f"takes {height} x {width} images; kfvision feeds square ones "
                   "(image_size x image_size): export it with a square input")
    fixed = height or width
    if spec.image_size is not None and fixed is not None and fixed != spec.image_size:
        raise _bad(spec.path, f"takes {fixed} x {fixed} images but {META_FILE} says image_size "
                   f"{spec.image_size}; make them agree")
    return spec.image_size or fixed or DEFAULT_IMAGE_SIZE


def _check_output(spec: ScriptModel, net, size: int, device: str) -> None:
    """One forward pass on a blank batch: the output must be [batch, classes]."""

    x = torch.zeros(2, 3, size, size, device=device)
    try:
        with torch.inference_mode():
            out = net(x)
    except Exception as e:  # the user's network: any error, with its cause
        raise _bad(spec.path, f"fails on a [2, 3, {size}, {size}] float32 batch ({type(e).__name__}"
                   f": {str(e)[:300]}); kfvision feeds image_size x image_size RGB images "
                   f"(image_size {size}: set it in {META_FILE})") from e
    if not isinstance(out, torch.Tensor):
        raise _bad(spec.path, f"returns {type(out).__name__}; kfvision needs one tensor "
                   "[batch, classes] (logits, or probabilities with \"output\": "
                   "\"probabilities\" in kfvision.json)")
    if tuple(out.shape) != (2, len(spec.classes)):
        raise _bad(spec.path, f"returns shape {list(out.shape)} for 2 images, but the model "
                   f"directory lists {len(spec.classes)} classes: it must return [batch, "
                   f"{len(spec.classes)}], one value per class in {CLASSES_FILE}'s order")


def load_script_model(model_dir, *, device: str = "cpu", threads: int | None = None):
    """(network: normalised float batch -> [batch, classes] logits, on `device`; info) of a
    script's model directory. The network is run once on a blank batch to check its output.

    Raises:
        InvalidModelDirectoryError: the layout or the model file is not what kfvision reads.
        DeviceError: an ONNX model asked to run on CUDA (it runs on onnxruntime's CPU provider).
    """
    spec = read_script_model(model_dir)
    if spec.format == "onnx":
        if device != "cpu":
            raise DeviceError(f"{spec.path} is ONNX, which kfvision runs on onnxruntime's CPU "
                              "provider: use --device cpu, or write model.pt2 to run on CUDA")
        net = OnnxNet(spec.path, threads)
        batch, height, width = net.shape
    else:
        load = _load_torchscript if spec.format == "torchscript" else _load_torch_export
        net, (batch, height, width) = load(spec.path, device)
        if spec.format == "torchscript":
            net.eval()  # a torch.export program kept the mode it was exported in
    size = _image_size(spec, height, width)
    wrapped = ScriptNet(net, batch, spec.output == "probabilities").eval()
    _check_output(spec, wrapped, size, device)
    return wrapped, spec.info(size)
