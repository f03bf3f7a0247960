"""The fast path: how data loading and compute run on this machine, resolved once at start-up.

Every switch has an explicit on/off value in TrainConfig; `auto` picks what measured faster on that
kind of device (docs/benchmarks.md), and is always numerically safe for training:
- cache: decoded images kept in memory when they fit (auto: a quarter of the available memory
  shared by this node's processes), so later epochs skip decoding;
- workers: none for cached data on CPU (augmenting cached tensors is cheap and workers would steal
  compute cores), otherwise one fewer than the cores per process, at most 8;
- amp: bfloat16 autocast where the hardware does bf16 matrix maths natively (CUDA with bf16, CPUs
  with AMX for images of 96 px and up); weights, optimiser state and the loss stay float32;
- channels_last: on where the convolutions are faster in NHWC (CUDA, and CPU oneDNN with bf16);
- compile: torch.compile of the model (off by default: on 2 CPU cores it costs more than it saves
  on short runs; see docs/benchmarks.md);
- gpu_decode: the training JPEGs decoded and augmented in batches on the device, workers only read
  files (trainer/data/devicedata.py); auto: on for CUDA when most training images are JPEGs and they
  are not cached (decoding every epoch on the CPU is then what a GPU step waits for);
- conv_gemm: convolutions with a one-pixel output run as one matrix multiply instead of through
  oneDNN, whose per-call weight re-layouts dominate such tiny convolutions, and only the kernel
  taps such an output sees are trained (trainer/model/convgemm.py); auto: on for CPU (cuDNN has no
  such cost);
- dct_scaling: training JPEGs decoded on the CPU (not on the device) are decoded at 1/2, 1/4 or
  1/8 size where the crops stay that much larger than the image size: every epoch knowing the
  random crop (trainer/data/decode.py: load_rgb_crop), or once for the cache at the scale every
  crop the preset can draw allows (TrainCrop.decode_factor).
"""

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trainer.distributed import DistContext, cpus_per_process

CPU_BF16_MIN_IMAGE_SIZE = 96


@dataclass(frozen=True)
class Runtime:
    cache: bool
    workers: int
    amp: bool
    channels_last: bool
    compile: bool
    gpu_decode: bool = False
    conv_gemm: bool = False
    dct_scaling: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_has_amx() -> bool:
    """True on CPUs with AMX bf16 tiles (oneDNN then runs bf16 convolutions much faster)."""
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def available_memory() -> int:
    """Bytes of memory available now (Linux), or 4 GiB when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def resolve_runtime(cfg, ctx: DistContext, decoded_bytes: int, jpeg_share: float = 0.0) -> Runtime:
    """The concrete fast-path settings from the config's auto/on/off values and this machine.

    `decoded_bytes`: of the training and validation images decoded; `jpeg_share`: the fraction
    of the training images that are JPEG files.
    """
    cuda = ctx.device.type == "cuda"
    fits = decoded_bytes <= available_memory() // (4 * ctx.local_world_size)
    cache = cfg.cache == "on" or (cfg.cache == "auto" and fits)
    cpus = cpus_per_process(ctx)
    if cfg.workers >= 0:
        workers = cfg.workers
    elif cache and not cuda:
        workers = 0
    else:
        workers = max(1, min(8, cpus - 1))
    # On CPU, bf16 pays only for large enough images: below that, oneDNN's layout reorders cost
    # more than the AMX tiles save (measured on a 2-core Sapphire Rapids: docs/benchmarks.md).
    native_bf16 = (torch.cuda.is_bf16_supported() if cuda else
                   cpu_has_amx() and cfg.image_size >= CPU_BF16_MIN_IMAGE_SIZE)
    amp = cfg.amp == "bf16" or (cfg.amp == "auto" and native_bf16)
    channels_last = cfg.channels_last == "on" or (cfg.channels_last == "auto" and (cuda or amp))
    gpu_decode = cfg.gpu_decode == "on" or (cfg.gpu_decode == "auto" and cuda and not cache
                                            and jpeg_share > 0.5)
    conv_gemm = cfg.conv_gemm == "on" or (cfg.conv_gemm == "auto" and not cuda)
    dct_scaling = cfg.dct_scaling == "on" and not gpu_decode
    return Runtime(cache, workers, amp, channels_last, cfg.compile == "on", gpu_decode, conv_gemm,
                   dct_scaling)


def describe(rt: Runtime) -> str:
    cache = ("on (validation only)" if rt.gpu_decode else "on") if rt.cache else "off"
    return (f"cache {cache}, workers {rt.workers}, "
            f"{'bf16 autocast' if rt.amp else 'fp32'}, "
            f"{'channels_last' if rt.channels_last else 'NCHW'}"
            f"{', torch.compile' if rt.compile else ''}"
            f"{', training JPEGs decoded on the device' if rt.gpu_decode else ''}"
            f"{', one-pixel convolutions as GEMM' if rt.conv_gemm else ''}"
            f"{', JPEGs decoded at reduced size where the crops allow' if rt.dct_scaling else ''}; "
            f"{os.cpu_count()} cores")
