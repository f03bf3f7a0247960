"""Loading the network of a script's model directory (the layout: trainer/model/scripted.py).

Whatever the format, the network comes back as kfvision calls every model: a module taking a
normalised float32 batch of any size and returning [batch, classes] logits (`ScriptNet`), checked
once on a blank batch. TorchScript and torch.export programs run in PyTorch on the device asked
for; ONNX runs on onnxruntime's CPU provider (imported only then).
"""

import warnings
import zipfile
from pathlib import Path

import torch
from torch import nn

from kfvision.trainer.errors import DeviceError
from kfvision.trainer.model.scripted import (
    CLASSES_FILE,
    DEFAULT_IMAGE_SIZE,
    META_FILE,
    SNIPPETS,
    ScriptModel,
    bad,
    read_script_model,
)


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


def _fixed_shape(path: Path, shape) -> tuple:
    """(batch, height, width) of the model's input shape, each an int where fixed, else None.
    Raises InvalidModelDirectoryError for an input kfvision cannot give: not [batch, 3, S, S]."""
    dims = [d if isinstance(d, int) and not isinstance(d, bool) else None for d in shape]
    if len(dims) != 4 or dims[1] not in (3, None):
        raise bad(path, f"takes input of shape {list(shape)}; kfvision gives [batch, 3, S, S] "
                  "(RGB images, channels first)")
    return dims[0], dims[2], dims[3]


def _load_torchscript(path: Path, device: str):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # TorchScript is deprecated, not gone
            return torch.jit.load(str(path), map_location=device), (None, None, None)
    except RuntimeError as e:
        raise bad(path, _not_what_it_says(path, "torchscript")) from e


def _load_torch_export(path: Path, device: str):
    try:
        with open(path, "rb") as f:  # a file object: any name works, not only *.pt2
            program = torch.export.load(f)
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        raise bad(path, _not_what_it_says(path, "torch-export")) from e
    inputs = [n for n in program.graph.nodes
              if n.op == "placeholder" and n.name in program.graph_signature.user_inputs]
    if len(inputs) != 1:
        raise bad(path, f"takes {len(inputs)} inputs; kfvision gives one, the image batch")
    shape = getattr(inputs[0].meta.get("val"), "shape", None)
    fixed = (None, None, None) if shape is None else _fixed_shape(path, shape)
    return program.module().to(device), fixed


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
            if "External data path" in str(e):
                raise bad(path, "keeps its weights in a file beside it that is not there (" +
                          str(e).rpartition(":")[2].strip()[:200] + "): copy every file "
                          "torch.onnx.export wrote, or export with external_data=False") from e
            raise bad(path, f"is not an ONNX model onnxruntime can load ({type(e).__name__}: "
                       f"{str(e)[:300]}). Write it with\n    {SNIPPETS['onnx']}") from e
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise bad(path, f"takes {len(inputs)} inputs; kfvision gives one, the image batch")
        if inputs[0].type != "tensor(float)":
            raise bad(path, f"takes {inputs[0].type}; kfvision gives float32 images, normalised "
                       "(a `kfvision export` file takes uint8: serve that file itself)")
        self.input, self.shape = inputs[0].name, _fixed_shape(path, inputs[0].shape)

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
        raise bad(spec.path, f"takes {height} x {width} images; kfvision feeds square ones "
                   "(image_size x image_size): export it with a square input")
    fixed = height or width
    if spec.image_size is not None and fixed is not None and fixed != spec.image_size:
        raise bad(spec.path, f"takes {fixed} x {fixed} images but {META_FILE} says image_size "
                   f"{spec.image_size}; make them agree")
    return spec.image_size or fixed or DEFAULT_IMAGE_SIZE


def _check_output(spec: ScriptModel, net, size: int, device: str) -> None:
    """One forward pass on a blank batch: the output must be [batch, classes]."""
    x = torch.zeros(2, 3, size, size, device=device)
    try:
        with torch.inference_mode():
            out = net(x)
    except Exception as e:  # the user's network: any error, with its cause
        raise bad(spec.path, f"fails on a [2, 3, {size}, {size}] float32 batch ({type(e).__name__}"
                   f": {str(e)[:300]}); kfvision feeds image_size x image_size RGB images "
                   f"(image_size {size}: set it in {META_FILE})") from e
    if not isinstance(out, torch.Tensor):
        raise bad(spec.path, f"returns {type(out).__name__}; kfvision needs one tensor "
                   "[batch, classes] (logits, or probabilities with \"output\": "
                   "\"probabilities\" in kfvision.json)")
    if tuple(out.shape) != (2, len(spec.classes)):
        raise bad(spec.path, f"returns shape {list(out.shape)} for 2 images, but the model "
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
