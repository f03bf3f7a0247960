"""OpenVINO's CPU plugin, the one module that talks to it: compiling a network (an ONNX file, or
a trained model directory's network converted by `ov.convert_model`) into a callable that
`Predictor` runs, and keeping the converted network on disk so a restart does not convert again.
"""

import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch


def openvino_run(model, threads: int):
    """run: uint8 batch -> probabilities of an ONNX file's path or an `ov.Model` on OpenVINO's
    CPU plugin.

    Compiled with one stream per `threads` usable CPUs, so that as many callers as the CPUs
    allow (the server's --model-streams) run their forward at once, each on its own InferRequest
    (one per calling thread: a request is not thread-safe). Non-quantized operations run in f32
    (not the bf16 OpenVINO picks on a CPU with AMX), so the accuracy `kfvision export` checked
    holds on any CPU, and an fp32 network gives PyTorch's probabilities. No pinning: the
    server's decoding threads share the cores.
    """
    import openvino as ov
    import openvino.properties as props
    import openvino.properties.hint as hints

    from trainer.distributed import usable_cpus

    streams = max(1, usable_cpus() // threads)  # a container's CPU limit, not the node's cores
    # the property names from openvino's own constants (NUM_STREAMS, INFERENCE_NUM_THREADS,
    # INFERENCE_PRECISION_HINT, ENABLE_CPU_PINNING in openvino 2026.4.1)
    compiled = ov.Core().compile_model(model if isinstance(model, ov.Model) else str(model),
                                       "CPU", {
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

    return run


def openvino_version() -> str | None:
    """OpenVINO's version, None where it is not installed."""
    try:
        import openvino as ov
    except ImportError:
        return None
    return ov.get_version()


def openvino_network(net: torch.nn.Module, info: dict, folder: Path | None):
    """The `ov.Model` of a trained model directory's `net` behind the export's wrapper (uint8
    in, probabilities out, normalisation inside), any batch size: read from `folder` where it
    was converted before, else converted by `ov.convert_model` and stored there in f32 (no fp16
    compression; `folder` None: not stored)."""
    import openvino as ov

    from trainer.use.autoruntime import prune
    from trainer.use.export import ServingModel

    if folder is not None and (folder / "model.xml").is_file():
        os.utime(folder)  # most recently used: kept when older ones are pruned
        return ov.Core().read_model(str(folder / "model.xml"))
    size = int(info["image_size"])
    wrapped = ServingModel(net, info["mean"], info["std"]).eval().requires_grad_(False)
    with torch.no_grad():
        model = ov.convert_model(wrapped, example_input=torch.zeros(2, 3, size, size,
                                                                    dtype=torch.uint8))
    model.reshape({0: ov.PartialShape([-1, 3, size, size])})
    if folder is not None:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        ov.save_model(model, str(tmp / "model.xml"), compress_to_fp16=False)
        try:
            tmp.rename(folder)
        except OSError:  # another process stored it first: theirs is the same network
            shutil.rmtree(tmp, ignore_errors=True)
        prune(folder.parent)
    return model


