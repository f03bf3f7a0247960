"""Predict from image files' bytes: the preprocessing `kfvision score` applies, one model in memory.

What a model server needs that scoring does not: the images arrive as bytes from strangers, so
each one is checked (an image at all, complete, within the pixel limit training has) before it is
decoded, and the failure says what was wrong with which image. The decoding is `score`'s: the
model's evaluation transform, a JPEG decoded at 1/2, 1/4 or 1/8 of its size where that resize
still only shrinks it (`EvalResize.decode_factor`), so a served label equals the scored label of
the same file. Three runtimes run the network: PyTorch on a trained model directory,
onnxruntime on a `kfvision export --format onnx` file (its metadata carries classes and
preprocessing), and OpenVINO on an int8 one (`kfvision export --quantize int8`), whose
int8 kernels on a CPU are several times onnxruntime's (docs/serving.md, "int8 on CPU").
`probabilities` may be called from several threads at once, each running its own forward.
"""

import io
import json
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from trainer.data.decode import load_rgb
from trainer.data.transforms import Normalizer, eval_transform
from trainer.errors import Int8CpuMismatchError, InvalidParameterError, KfvisionError, check_choice

# "auto": for a kfvision model directory on the CPU, PyTorch or OpenVINO fp32 by a probe
# (trainer/use/autoruntime.py); for any other model, what `default_runtime` says
RUNTIMES = ("auto", "torch", "onnx", "openvino")


class InvalidImageError(KfvisionError, ValueError):
    """Bytes given as an image file are not one that can be served: not an image, truncated, or
    over the pixel limit."""


def _reject(where: str, what: str) -> InvalidImageError:
    return InvalidImageError(f"{where} {what}")


def decode_image(data: bytes, transform, where: str = "image") -> torch.Tensor:
    """The image file `data` as the model's uint8 RGB CHW input, decoded as `score` decodes it.

    Raises:
        InvalidImageError: empty, not an image, truncated, or more pixels than
            PIL.Image.MAX_IMAGE_PIXELS (the limit `kfvision convert` applies to training data).
    """
    if not data:
        raise _reject(where, "is empty (0 bytes)")
    limit = Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # we refuse below
            im = Image.open(io.BytesIO(data))
        width, height = im.size
        fmt = im.format
    except Image.DecompressionBombError as e:
        raise _reject(where, f"is refused as a decompression bomb ({e})") from e
    except Image.UnidentifiedImageError as e:
        raise _reject(where, "is not an image file (Pillow cannot identify its format)") from e
    except Exception as e:  # Pillow raises many types on malformed data; the reason is kept
        raise _reject(where, f"is not an image file Pillow can read ({type(e).__name__}: "
                      f"{e})") from e
    if limit and width * height > limit:
        raise _reject(where, f"is {width} x {height} = {width * height:,} pixels, over the limit "
                      f"of {limit:,} (PIL.Image.MAX_IMAGE_PIXELS); refused as a possible "
                      "decompression bomb")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            if fmt == "JPEG":
                img = _decode_jpeg(im, transform.decode_factor(height, width))
            else:  # score's path for every other format (16-bit grayscale scaled, etc.)
                img = load_rgb("request-image", torch.frombuffer(bytearray(data),
                                                                 dtype=torch.uint8))
    except Exception as e:  # truncated data, decoder errors
        raise _reject(where, f"cannot be decoded ({type(e).__name__}: {e}); is it complete?") \
            from e
    return transform(img)


def _decode_jpeg(im: Image.Image, factor: int) -> torch.Tensor:
    """A JPEG through Pillow's libjpeg at 1/factor of its size (score's `_draft_decode` request),
    loaded strictly: a truncated file raises instead of decoding grey."""
    if factor > 1:
        im.draft(None, (im.width // factor, im.height // factor))
    im.load()
    rgb = im if im.mode == "RGB" else im.convert("RGB")
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1)


def onnx_metadata(path) -> dict:
    """The kfvision metadata of an ONNX export (without loading a runtime)."""
    import onnx

    from trainer.use.export import META_KEY

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends: not an ONNX file at all
        raise KfvisionError(f"{path} is not an ONNX file ({type(e).__name__}: {e}); give a "
                            "trained model directory or a file `kfvision export --format onnx` "
                            "wrote") from e
    props = {p.key: p.value for p in proto.metadata_props}
    if META_KEY not in props:
        raise KfvisionError(f"{path} is an ONNX file without kfvision's metadata ('{META_KEY}'): "
                            "serve a file `kfvision export --format onnx` wrote")
    return json.loads(props[META_KEY])


def default_runtime(model) -> str:
    """torch for a model directory (onnx for a script's that holds an ONNX model); for an ONNX
    file, the runtime its metadata names (an int8 export's), else onnx."""
    if not Path(model).is_file():
        return "onnx" if _script_format(model) == "onnx" else "torch"
    return onnx_metadata(model).get("quantization", {}).get("runtime", "onnx")


def _script_format(model_dir) -> str | None:
    """The model format of a script's model directory (None: not one, or not readable)."""
    from trainer.model.scripted import read_script_model
    from trainer.model.trained import is_trained_model

    if is_trained_model(model_dir):
        return None
    try:
        return read_script_model(model_dir).format
    except KfvisionError:
        return None  # the loader says what is wrong


def onnx_session(path, threads: int):
    """(run: uint8 batch -> probabilities, metadata) of an ONNX export on onnxruntime's CPU
    provider. Its threads do not spin while idle: a server decodes images on the same cores.
    `InferenceSession.run` is thread-safe: concurrent callers each run their own forward."""
    import onnxruntime as ort

    from trainer.use.export import META_KEY

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    meta = json.loads(session.get_modelmeta().custom_metadata_map[META_KEY])

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {"image": x.contiguous().numpy()})[0])

    return run, meta


def inference_net(net: torch.nn.Module) -> torch.nn.Module:
    """`net` (in eval mode) for serving: every BatchNorm folded into the convolution before it
    (torch.fx's `fuse`) and the weights channels-last. On a CPU, oneDNN's convolutions run
    1.3-1.5x faster that way (ResNet-18 at 224 px, one thread: docs/serving.md); the
    probabilities stay within float32 rounding (about 1e-6) of the module's own. A network
    torch.fx cannot trace is only made channels-last."""
    from torch.fx.experimental.optimization import fuse

    try:
        return fuse(net.eval()).to(memory_format=torch.channels_last)  # a copy; net is untouched
    except Exception:  # symbolic tracing fails on data-dependent control flow; unfused is exact
        return net.to(memory_format=torch.channels_last)


def openvino_model(path, threads: int):
    """(run: uint8 batch -> probabilities, metadata) of an ONNX export (an int8 one: QDQ) on
    OpenVINO's CPU plugin (`openvino_run`)."""
    from trainer.use.ovruntime import openvino_run

    return openvino_run(path, threads), onnx_metadata(path)


LOADERS = {"onnx": onnx_session, "openvino": openvino_model}  # runtime -> (run, metadata)


def check_int8_cpu(meta: dict, path, cpu=None) -> None:
    """Refuse an int8 export whose weights this CPU's int8 kernels would saturate.

    An export quantized with full 8-bit weights (on a CPU with VNNI or AMX: `int8_reduce_range`)
    loses its checked accuracy on a CPU without VNNI, whose kernels add pairs of u8 x s8 products
    in 16 bits (on the digits, agreement with fp32 fell from 100% to 83%). Re-checking here would
    need the check data, which a server does not have; so the export is refused with what to do.
    An export with 7-bit weights serves correctly on any CPU. Exports from before the choice was
    recorded have full 8-bit weights.

    Raises:
        Int8CpuMismatchError: full-range int8 weights on a CPU without VNNI.
    """
    from trainer.fastpath import cpu_features, describe_cpu

    q = meta.get("quantization")
    if not q or q.get("reduce_range", False):
        return
    cpu = cpu or cpu_features()
    if cpu.vnni:
        return
    made_on = q.get("cpu", {})
    raise Int8CpuMismatchError(
        f"{path} was quantized with full 8-bit weights for a CPU with VNNI ("
        f"{made_on.get('model') or 'another machine'}, {made_on.get('kind', 'kind not recorded')})"
        f", but this one has no VNNI ({describe_cpu(cpu)}): its int8 kernels add pairs of "
        "products in 16 bits and would saturate these weights, so the accuracy the export "
        "checked would not hold. Re-export on this machine (kfvision export --quantize int8 "
        "picks 7-bit weights here and checks them on these kernels), or serve the fp32 export.")


class Predictor:
    """A trained model (or its ONNX export) with its classes and evaluation transform, loaded
    once: `preprocess` one file's bytes, `probabilities` of a uint8 batch.

    Args:
        model: a trained model directory (runtime "torch", or "openvino": its network converted),
            a script's model directory ("torch" for TorchScript and torch.export, "onnx" for
            ONNX: trainer/model/scripted.py) or an ONNX export ("onnx", or "openvino").
        runtime: one of RUNTIMES; None picks by `model` (`default_runtime`); "auto" also
            chooses between PyTorch and OpenVINO fp32 for a trained model directory on the CPU
            (trainer/use/autoruntime.py). `choice` says what was chosen and why.
        device: "cpu" or "cuda" (torch runtime only).
        threads: intra-op threads of the forward pass (None: the runtime's default).
        batch: the largest batch it will be given (what `auto`'s probe times).
        cache: where `auto` keeps its probes and converted networks (None: nowhere).
    """

    def __init__(self, model, runtime: str | None = None, device: str = "cpu",
                 threads: int | None = None, *, batch: int = 8, cache: Path | None = None):
        model = Path(model)
        self.threads = threads
        check_choice("runtime", runtime or "auto", RUNTIMES)
        self.choice = f"--runtime {runtime}" if runtime and runtime != "auto" else \
            "by the model"
        if runtime == "auto" and (device == "cuda" or model.is_file()):
            runtime = "torch" if device == "cuda" else None  # OpenVINO's runtime is CPU only
            self.choice = f"auto: {'PyTorch on CUDA' if device == 'cuda' else 'by the model'}"
        if runtime == "openvino" and device == "cuda" and not model.is_file():
            raise InvalidParameterError("runtime = 'openvino' runs on the CPU; with device = "
                                        "'cuda' give runtime = 'torch' (or none).")
        runtime = runtime or default_runtime(model)
        self.runtime, self.source = runtime, model
        if not model.is_file():  # a directory: kfvision's, or a script's
            info = self._load_directory(model, runtime, device, batch, cache)
        else:
            check_int8_cpu(onnx_metadata(model), model)
            self._run, info = LOADERS[runtime](model, self._threads())
        self._meta = info if model.is_file() else None
        self.classes = list(info["classes"])
        self.image_size = int(info["image_size"])
        self.transform = eval_transform(info["eval_preset"], self.image_size)

    def _threads(self) -> int:
        return self.threads or torch.get_num_threads()

    def _load_directory(self, model: Path, runtime: str, device: str, batch: int, cache) -> dict:
        """Load a model directory's network into `_run` on `runtime` ("auto" resolved here)."""
        from trainer.model.trained import load_model

        net, info = load_model(model, device=device, threads=self.threads)
        wanted = "onnx" if info.get("model_format") == "onnx" else "torch"
        own = wanted == "torch" and "model_format" not in info  # kfvision's, not a script's
        if runtime == "auto" and not own:
            runtime, self.choice = wanted, "auto: by the model"
        if runtime != wanted and not (own and runtime in ("auto", "openvino")):
            raise InvalidParameterError(
                f"runtime = {runtime!r} cannot run {model}: "
                f"{info.get('model_file', 'its network')} runs on {wanted}"
                f"{'' if not own else ' or openvino'}.")
        self.device = torch.device("cuda" if device == "cuda" else "cpu")
        self._normalize = Normalizer(tuple(info["mean"]), tuple(info["std"]))
        # kfvision's own network is folded for speed; a script's runs as the script saved it
        self._net = inference_net(net) if own else net
        self._run = self._run_torch
        if runtime in ("openvino", "auto"):
            from trainer.use import autoruntime
            from trainer.use.ovruntime import openvino_network, openvino_run, openvino_version

            version, digest = openvino_version(), autoruntime.model_hash(model)
            folder = autoruntime.ir_folder(cache, digest, version or "")

            def ov_run(where):
                return openvino_run(openvino_network(net, info, where), self._threads())
        if runtime == "openvino":
            self._run, self._net = ov_run(folder), None
        elif runtime == "auto":
            choice, self._run = autoruntime.choose(
                digest, int(info["image_size"]), lambda x: self._forward(self._run_torch, x),
                ov_run, version=version, threads=self._threads(), batch=batch, cache=cache)
            runtime, self.choice = choice.runtime, choice.reason
            if runtime == "openvino":
                self._net = None  # only OpenVINO's copy of the weights stays in memory
        self.runtime = runtime
        return info

    def _run_torch(self, batch: torch.Tensor) -> torch.Tensor:
        # score's arithmetic (Normalizer, then softmax), so the probabilities match its table
        x = self._normalize(batch.to(self.device), torch.channels_last)
        return self._net(x).softmax(dim=1).cpu()

    def preprocess(self, data: bytes, where: str = "image") -> torch.Tensor:
        """`decode_image` with this model's transform."""
        return decode_image(data, self.transform, where)

    def probabilities(self, batch: torch.Tensor) -> np.ndarray:
        """float32 [n, classes] for a uint8 [n, 3, S, S] batch."""
        return self._forward(self._run, batch).numpy().astype(np.float32, copy=False)

    def _forward(self, run, batch: torch.Tensor) -> torch.Tensor:
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # OpenMP's setting is the calling thread's
        with torch.inference_mode():
            return run(batch)

    def describe(self) -> dict:
        """What a client needs to know: classes, input size, runtime (and why it runs)."""
        return {"classes": self.classes, "image_size": self.image_size,
                "runtime": self.runtime, "runtime_choice": self.choice,
                "model": str(self.source)}

    def fast_path(self) -> dict:
        """The CPU speed choices this model is served with and the CPU they were taken for, as
        strings (for the serving `/metrics`' kfvision_fast_path info)."""
        from trainer.fastpath import cpu_features

        cpu = cpu_features()
        choices = {"runtime": self.runtime, "runtime_choice": self.choice,
                   "cpu_model": cpu.model, "cpu_kind": cpu.kind,
                   "isa_cap": cpu.isa_cap or "none", "vnni": str(cpu.vnni).lower(),
                   "threads": str(self.threads or torch.get_num_threads())}
        if self.runtime == "torch":
            choices["graph"] = "batch norms folded, channels_last"
        if self.runtime == "openvino":
            choices["precision_hint"] = "f32"
        q = self._meta.get("quantization") if self._meta else None
        if q:
            choices["int8_weights"] = "7-bit" if q.get("reduce_range") else "8-bit"
        return choices
