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
import threading
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from kfvision.trainer.data.decode import load_rgb
from kfvision.trainer.data.transforms import Normalizer, eval_transform
from kfvision.trainer.errors import (
    Int8CpuMismatchError,
    InvalidParameterError,
    KfvisionError,
    check_choice,
)

RUNTIMES = ("torch", "onnx", "openvino")


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

    from kfvision.trainer.use.export import META_KEY

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
    from kfvision.trainer.model.layout import is_trained_model
    from kfvision.trainer.model.scripted import read_script_model

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

    from kfvision.trainer.use.export import META_KEY

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
    OpenVINO's CPU plugin.

    Compiled with one stream per `threads` usable CPUs, so that as many callers as the CPUs
    allow (the server's --model-streams) run their forward at once, each on its own InferRequest
    (one per calling thread: a request is not thread-safe). Non-quantized operations run in f32
    (not the bf16 OpenVINO picks on a CPU with AMX), so the accuracy `kfvision export` checked
    holds on any CPU. No pinning: the server's decoding threads share the cores.
    """
    import openvino as ov
    import openvino.properties as props
    import openvino.properties.hint as hints

    from kfvision.trainer.cpus import usable_cpus

    streams = max(1, usable_cpus() // threads)  # a container's CPU limit, not the node's cores
    # the property names from openvino's own constants (NUM_STREAMS, INFERENCE_NUM_THREADS,
    # INFERENCE_PRECISION_HINT, ENABLE_CPU_PINNING in openvino 2026.4.1)
    compiled = ov.Core().compile_model(str(path), "CPU", {
        props.num_streams(): streams, props.inference_num_threads(): streams * threads,
        hints.inference_precision(): ov.Type.f32, hints.enable_cpu_pinning(): False})
    local = threading.local()

    def run(x: torch.Tensor) -> torch.Tensor:
        request = getattr(local, "request", None)
        if request is None:
            request = local.request = compiled.create_infer_request()
        request.infer({0: x.contiguous().numpy()})
        # copied: the output tensor is the request's and the next forward overwrites it
        return torch.from_numpy(request.get_output_tensor(0).data.copy())

    return run, onnx_metadata(path)


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
    from kfvision.trainer.fastpath import cpu_features, describe_cpu

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
        model: a trained model directory (runtime "torch"), a script's model directory ("torch"
            for TorchScript and torch.export, "onnx" for ONNX: trainer/model/scripted.py) or an
            ONNX export ("onnx", or "openvino" for an int8 export).
        runtime: one of RUNTIMES; None picks by `model` (`default_runtime`).
        device: "cpu" or "cuda" (torch runtime only).
        threads: intra-op threads of the forward pass (None: the runtime's default).
    """

    def __init__(self, model, runtime: str | None = None, device: str = "cpu",
                 threads: int | None = None):
        model = Path(model)
        self.threads = threads
        runtime = runtime or default_runtime(model)
        check_choice("runtime", runtime, RUNTIMES)
        self.runtime, self.source = runtime, model
        if runtime == "torch" or not model.is_file():  # a directory: kfvision's, or a script's
            from kfvision.trainer.model.trained import load_model

            net, info = load_model(model, device=device, threads=threads)
            wanted = "onnx" if info.get("model_format") == "onnx" else "torch"
            if runtime != wanted:
                raise InvalidParameterError(
                    f"runtime = {runtime!r} cannot run {model}: "
                    f"{info.get('model_file', 'its network')} runs on {wanted}.")
            self.device = torch.device("cuda" if device == "cuda" else "cpu")
            # kfvision's own network is folded for speed; a script's runs as the script saved it
            self._net = inference_net(net) if wanted == "torch" and "model_format" not in info \
                else net
            self._normalize = Normalizer(tuple(info["mean"]), tuple(info["std"]))
            self._run = self._run_torch
        else:
            check_int8_cpu(onnx_metadata(model), model)
            self._run, info = LOADERS[runtime](model, threads or torch.get_num_threads())
        self._meta = None if runtime == "torch" else info
        self.classes = list(info["classes"])
        self.image_size = int(info["image_size"])
        self.transform = eval_transform(info["eval_preset"], self.image_size)

    def _run_torch(self, batch: torch.Tensor) -> torch.Tensor:
        # score's arithmetic (Normalizer, then softmax), so the probabilities match its table
        x = self._normalize(batch.to(self.device), torch.channels_last)
        return self._net(x).softmax(dim=1).cpu()

    def preprocess(self, data: bytes, where: str = "image") -> torch.Tensor:
        """`decode_image` with this model's transform."""
        return decode_image(data, self.transform, where)

    def probabilities(self, batch: torch.Tensor) -> np.ndarray:
        """float32 [n, classes] for a uint8 [n, 3, S, S] batch."""
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # OpenMP's setting is the calling thread's
        with torch.inference_mode():
            return self._run(batch).numpy().astype(np.float32, copy=False)

    def describe(self) -> dict:
        """What a client needs to know: classes, input size, runtime."""
        return {"classes": self.classes, "image_size": self.image_size,
                "runtime": self.runtime, "model": str(self.source)}

    def fast_path(self) -> dict:
        """The CPU speed choices this model is served with and the CPU they were taken for, as
        strings (for the serving `/metrics`' kfvision_fast_path info)."""
        from kfvision.trainer.fastpath import cpu_features

        cpu = cpu_features()
        choices = {"runtime": self.runtime, "cpu_model": cpu.model, "cpu_kind": cpu.kind,
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
