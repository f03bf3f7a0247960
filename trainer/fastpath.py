"""The fast path: how data loading and compute run on this machine, resolved once at start-up.

The processor is read in one place, `cpu_features` (`/proc/cpuinfo`'s flags less what
ONEDNN_MAX_CPU_ISA hides from the kernels): its kind (AMX, AVX512_BF16, AVX-512, AVX2 only)
and VNNI. Every CPU speed choice reads it, here (bf16, and channels_last with it) and for int8
(`int8_reduce_range`); the resolved FastPath carries it (`cpu`) into metrics.json and config.yaml.
docs/benchmarks.md says which choice depends on which feature.

Every switch has an explicit on/off value in TrainConfig; `auto` picks what measured faster on that
kind of device (docs/benchmarks.md), and is always numerically safe for training:
- cache: decoded images kept in memory when they fit (auto: a quarter of the available memory
  shared by this node's processes, and not while the images arrive from object storage), so
  later epochs skip decoding;
- workers: none for cached data on CPU (augmenting cached tensors is cheap and workers would steal
  compute cores), otherwise one fewer than the cores per process, at most 8;
- amp: bfloat16 autocast where the hardware does bf16 matrix maths natively and it pays: CUDA
  with bf16; CPUs whose oneDNN has bf16 instructions (AMX tiles, or AVX512_BF16 dot products)
  for images at least as large as the threshold measured for that kind (CPU_BF16_MIN_IMAGE_SIZE;
  below it the layout reorders cost more than the bf16 maths saves). Weights, optimiser state and
  the loss stay float32. The start-up line says why (`bf16 autocast (AVX512_BF16, 224 px)`);
  `--amp bf16` on a CPU with neither runs (PyTorch emulates bf16 there) and says it is slower;
- channels_last: on where the convolutions are faster in NHWC (CUDA, and CPU oneDNN with bf16);
- compile: torch.compile of the model (off by default for every family: on a CPU, at 32 px, the
  compiled step was no faster for ResNet and paid its minutes of compilation back only after ~80
  epochs of the digits for RegNet; at 224 px it lost for RegNet, tied for ViT and Swin, and paid
  back after ~1,800 images for ConvNeXt, thousands for the others; docs/benchmarks.md, "The fast
  path per family");
- gpu_decode: the training JPEGs decoded (nvJPEG), cropped, resized and flipped in batches on the
  device, workers only read files (trainer/data/devicedata.py, batchcrop.py); auto: on for CUDA
  when most training images are JPEGs, whether or not they fit the cache (which then keeps the
  validation images only: augmenting cached images on the CPU is what a GPU step waited for);
  `gpu_decode_reason` records why, in metrics.json and config.yaml;
- conv_gemm: convolutions with a one-pixel output run as one matrix multiply instead of through
  oneDNN, whose per-call weight re-layouts dominate such tiny convolutions, and only the kernel
  taps such an output sees are trained (trainer/model/convgemm.py); auto: on for CPU (cuDNN has no
  such cost);
- dct_scaling: training JPEGs decoded on the CPU (not on the device) are decoded at 1/2, 1/4 or
  1/8 size where the crops stay that much larger than the image size: every epoch knowing the
  random crop (trainer/data/decode.py: load_rgb_crop), or once for the cache at the scale every
  crop the preset can draw allows (TrainCrop.decode_factor).

Per family: `auto` takes, for the families in FAMILY_CHOICES, the choices measured for them on a
CPU (bench/families.py; docs/benchmarks.md, "The fast path per family"): off where one lost or
broke, on where one won against what `auto` would otherwise do; the resolved FastPath names the
family and those choices (`family`, `family_choices`).
"""

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kfvision.trainer.distributed import DistContext, cpus_per_process
from kfvision.trainer.presets import CPU_BF16_MIN_IMAGE_SIZE

# The speed choices `auto` takes on a CPU for a family where its measurement departs from the
# rule for every model (FastPath field name -> (on, why)), measured with bench/families.py on the
# processor docs/benchmarks.md names ("The fast path per family"). A family not listed takes what
# `auto` takes on its device; `on`/`off` given by hand still win; CUDA is not measured per family
# (every family takes `auto`'s CUDA choices). The one place a family's fast path is decided.
FAMILY_CHOICES: dict[str, dict[str, tuple[bool, str]]] = {
    "mobilenetv3": {
        "amp": (False, "bf16 autocast trained mobilenet_v3_large 0.79x (0.77-0.81) as fast as "
                       "fp32 at 224 px on the EPYC (AVX512_BF16)"),
        "channels_last": (True, "fp32 channels-last trained it 1.44x (1.25-1.63) as fast as "
                                "fp32 NCHW at 224 px on the EPYC (AVX512_BF16)")},
    "regnet": {"conv_gemm": (False, "one-pixel convolutions as GEMM trained regnet_y_1_6gf 0.92x "
                                    "(0.87-1.02, 4 interleaved rounds; 0.89x in 2 earlier ones) "
                                    "as fast as oneDNN's, bf16, at 224 px on the EPYC "
                                    "(AVX512_BF16)")},
}
# swin_transformer: channels-last measured a tie with NCHW in bf16 (1.06x, 0.90-1.24, 4
# interleaved rounds loaded; 0.99x, 0.92-1.04, 4 more on a quiet machine), so it keeps `auto`'s
# rule (docs/benchmarks.md, "The fast path per family").


def family_choices(family: str | None, cuda: bool) -> dict:
    """{choice: (on, why)} `auto` takes for this family on this kind of device (FAMILY_CHOICES)."""
    return {} if cuda else FAMILY_CHOICES.get(family or "", {})


@dataclass(frozen=True)
class FastPath:
    cache: bool
    workers: int
    amp: bool
    channels_last: bool
    compile: bool
    gpu_decode: bool = False
    conv_gemm: bool = False
    dct_scaling: bool = False
    amp_reason: str = ""  # why amp is on or off, for the start-up line
    gpu_decode_reason: str = ""  # why gpu_decode is on or off
    cpu: dict = field(default_factory=dict)  # CpuFeatures.to_dict() of the CPU that chose
    family: str = ""  # the model's family ("" for a script's model)
    family_choices: dict = field(default_factory=dict)  # what `auto` took for it, and why

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_info(path="/proc/cpuinfo") -> tuple[str, frozenset]:
    """(model name, flags) of the first processor in /proc/cpuinfo; ("", empty) where unknown.
    The one place the processor is read (tests replace it to be any CPU)."""
    model, flags = "", frozenset()
    try:
        text = Path(path).read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return model, flags


# oneDNN's dispatcher control, read by the oneDNN in torch and in OpenVINO's CPU plugin (oneDNN
# v3 docs, dev_guide_cpu_dispatcher_control: "ONEDNN_MAX_CPU_ISA"): the newest instructions its
# kernels may use. A capped process runs the kernels of an older CPU, so its fast-path choices
# must be that CPU's: each value keeps the flags below that its kernels may use.
ONEDNN_MAX_CPU_ISA = "ONEDNN_MAX_CPU_ISA"
_AVX2 = ("avx2", "fma")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")
_AMX = ("amx_tile", "amx_int8", "amx_bf16")
_ISA_CAPS = {
    "SSE41": (), "AVX": (), "AVX2": _AVX2, "AVX2_VNNI": (*_AVX2, "avx_vnni"),
    "AVX2_VNNI_2": (*_AVX2, "avx_vnni"), "AVX512_CORE": _AVX512,
    "AVX512_CORE_VNNI": (*_AVX512, "avx512_vnni"),
    "AVX512_CORE_BF16": (*_AVX512, "avx512_vnni", "avx512_bf16"),
    "AVX512_CORE_FP16": (*_AVX512, "avx512_vnni", "avx512_bf16", "avx512_fp16"),
    "AVX512_CORE_AMX": (*_AVX512, "avx512_vnni", "avx512_bf16", "avx512_fp16", *_AMX),
}
_CAPPED = ("avx2", "fma", "avx_vnni", "avx512", "amx")  # the flags (prefixes) a cap can hide


def onednn_isa_cap() -> str | None:
    """The ONEDNN_MAX_CPU_ISA this process runs under (upper case), None when uncapped."""
    cap = os.environ.get(ONEDNN_MAX_CPU_ISA, "").strip().upper()
    return cap if cap in _ISA_CAPS else None


@dataclass(frozen=True)
class CpuFeatures:
    """The running CPU as its kernels see it: /proc/cpuinfo's flags, less what ONEDNN_MAX_CPU_ISA
    hides. Every CPU speed choice of kfvision is taken from one of these (docs/benchmarks.md,
    "Which choice depends on which feature")."""

    model: str
    flags: frozenset
    isa_cap: str | None = None
    cores: int = 1

    @property
    def kind(self) -> str:
        """"AMX", "AVX512_BF16", "AVX-512", "AVX2 only" or "older than AVX2": what the CPU's
        matrix maths can use, newest first."""
        if {"amx_tile", "amx_bf16"} <= self.flags:
            return "AMX"
        if "avx512_bf16" in self.flags:
            return "AVX512_BF16"
        if "avx512f" in self.flags:
            return "AVX-512"
        return "AVX2 only" if "avx2" in self.flags else "older than AVX2"

    @property
    def vnni(self) -> bool:
        """u8 x s8 dot products accumulated in 32 bits (AVX512_VNNI, AVX-VNNI or AMX): without
        them the int8 kernels add pairs of products in 16 bits, which saturate."""
        return bool(self.flags & {"avx512_vnni", "avx_vnni", "amx_int8"})

    def to_dict(self) -> dict:
        shown = sorted(f for f in self.flags if f.startswith(_CAPPED))
        return {"model": self.model, "kind": self.kind, "vnni": self.vnni, "flags": shown,
                "isa_cap": self.isa_cap, "cores": self.cores}


def cpu_features() -> CpuFeatures:
    """The running CPU (`cpu_info`) under this process's ONEDNN_MAX_CPU_ISA."""
    model, flags = cpu_info()
    cap = onednn_isa_cap()
    if cap is not None:
        allowed = set(_ISA_CAPS[cap])
        flags = frozenset(f for f in flags if not f.startswith(_CAPPED) or f in allowed)
    return CpuFeatures(model, flags, cap, os.cpu_count() or 1)


def cpu_bf16_kind(flags: frozenset | None = None) -> str | None:
    """The CPU's native bf16 matrix maths that oneDNN uses: "AMX" (tiles), "AVX512_BF16" (dot
    product instructions), or None (bf16 would be emulated through fp32: never faster)."""
    if flags is None:
        flags = cpu_features().flags
    if not torch.backends.mkldnn.is_available():
        return None
    if {"amx_bf16", "amx_tile"} <= flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512_BF16"
    return None


def cpu_bf16_decision(image_size: int, cpu: CpuFeatures | None = None) -> tuple[bool, str]:
    """Whether `--amp auto` turns bf16 autocast on for this CPU at this image size, and why."""
    kind = cpu_bf16_kind((cpu or cpu_features()).flags)
    if kind is None:
        return False, "no native bf16 on this CPU (neither AMX nor AVX512_BF16)"
    least = CPU_BF16_MIN_IMAGE_SIZE[kind]
    if image_size < least:
        return False, f"{kind}, but {image_size} px < {least} px"
    return True, f"{kind}, {image_size} px"


def auto_choices(family: str | None, cuda: bool, image_size: int,
                 cpu: CpuFeatures | None = None) -> dict:
    """What `auto` picks for this family on this device: {"amp", "channels_last", "conv_gemm"} ->
    (on, why); a choice FAMILY_CHOICES sets for the family is as it says, saying so."""
    fixed = family_choices(family, cuda)

    def said(choice: str) -> tuple[bool, str]:
        on, why = fixed[choice]
        return on, f"{'on' if on else 'off'} for {family}: {why}"
    if "amp" in fixed:
        amp = said("amp")
    elif cuda:
        bf16 = torch.cuda.is_bf16_supported()
        amp = (bf16, "CUDA" if bf16 else "this GPU has no bf16")
    else:
        amp = cpu_bf16_decision(image_size, cpu)
    layout = (cuda or amp[0], "CUDA or bf16" if cuda or amp[0] else "fp32 on a CPU")
    return {"amp": amp,
            "channels_last": said("channels_last") if "channels_last" in fixed else layout,
            "conv_gemm": said("conv_gemm") if "conv_gemm" in fixed else (not cuda, "CPU")}


def int8_reduce_range(cpu: CpuFeatures | None = None) -> bool:
    """Whether int8 weights are quantized to 7 bits for this CPU: yes without VNNI, whose int8
    kernels (oneDNN's in OpenVINO, MLAS's in onnxruntime) add pairs of u8 x s8 products in 16
    bits that full-range weights saturate; onnxruntime's quantize_static documents reduce_range
    for "non-VNNI" machines. With VNNI the eighth bit is kept (a little more accurate)."""
    return not (cpu or cpu_features()).vnni


def describe_cpu(cpu: CpuFeatures | None = None) -> str:
    """The CPU model, its kind and the flags the fast path's CPU rules depend on, for benchmark
    results and start-up lines."""
    cpu = cpu or cpu_features()
    shown = sorted(cpu.flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
                                "amx_tile", "amx_bf16", "amx_int8"})
    cap = f", kernels capped at {ONEDNN_MAX_CPU_ISA}={cpu.isa_cap}" if cpu.isa_cap else ""
    return (f"CPU: {cpu.model or 'unknown'} ({cpu.kind}{cap}), {cpu.cores} cores, flags "
            f"{' '.join(shown) or '-'} (bf16 for --amp auto: {cpu_bf16_kind(cpu.flags) or 'none'}"
            f"; int8: {'VNNI' if cpu.vnni else 'no VNNI, 7-bit weights'})")


def available_memory() -> int:
    """Bytes of memory available now (Linux), or 4 GiB when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def resolve_fast_path(cfg, ctx: DistContext, decoded_bytes: int,
                      jpeg_share: float = 0.0, arriving: bool = False,
                      family: str | None = None) -> FastPath:
    """The concrete fast-path settings from the config's auto/on/off values and this machine.

    `decoded_bytes`: of the training and validation images decoded; `jpeg_share`: the fraction
    of the training images that are JPEG files; `arriving`: the images are fetched from object
    storage as the sampler asks for them (trainer/data/arrival.py), so `--cache auto` does not
    cache: the cache decodes every image before the first step, which would fetch the whole
    dataset to every node first. `family`: the model's (FAMILY_CHOICES), None for a script's model.
    """
    cuda = ctx.device.type == "cuda"
    cpu = cpu_features()
    fits = decoded_bytes <= available_memory() // (4 * ctx.local_world_size)
    cache = cfg.cache == "on" or (cfg.cache == "auto" and fits and not arriving)
    cpus = cpus_per_process(ctx)
    if cfg.workers >= 0:
        workers = cfg.workers
    elif cache and not cuda:
        workers = 0
    else:
        workers = max(1, min(8, cpus - 1))
    auto = auto_choices(family, cuda, cfg.image_size, cpu)
    if cfg.amp != "auto":
        amp, amp_reason = cfg.amp == "bf16", f"--amp {cfg.amp}"
        if amp and not cuda and not cpu_bf16_kind(cpu.flags):
            amp_reason += "; emulated: this CPU has neither AMX nor AVX512_BF16, slower than fp32"
    else:
        amp, amp_reason = auto["amp"]
    fixed = family_choices(family, cuda)
    # auto: the family's measured layout, else NHWC where bf16 (or CUDA) is on
    layout = fixed["channels_last"][0] if "channels_last" in fixed else cuda or amp
    channels_last = cfg.channels_last == "on" or (cfg.channels_last == "auto" and layout)
    gpu_decode, gpu_decode_reason = _gpu_decode(cfg.gpu_decode, cuda, cache, jpeg_share)
    conv_gemm = cfg.conv_gemm == "on" or (cfg.conv_gemm == "auto" and auto["conv_gemm"][0])
    dct_scaling = cfg.dct_scaling == "on" and not gpu_decode
    asked = {"amp": cfg.amp, "channels_last": cfg.channels_last, "conv_gemm": cfg.conv_gemm}
    taken = {c: f"{'on' if on else 'off'}: {why}" for c, (on, why) in fixed.items()
             if asked.get(c) == "auto"}
    return FastPath(cache, workers, amp, channels_last, cfg.compile == "on", gpu_decode, conv_gemm,
                    dct_scaling, amp_reason, gpu_decode_reason, cpu.to_dict(), family or "",
                    taken)


def _gpu_decode(setting: str, cuda: bool, cache: bool, jpeg_share: float) -> tuple[bool, str]:
    """Whether the training JPEGs are decoded and augmented on the device, and why."""
    if setting != "auto":
        return setting == "on", f"--gpu-decode {setting}"
    if not cuda:
        return False, "auto: not CUDA (the CPU path decodes in its workers)"
    if jpeg_share <= 0.5:
        return False, f"auto: {jpeg_share:.0%} of the training images are JPEGs"
    # cached or not: augmenting cached images on the CPU fed the GPU more slowly than decoding and
    # augmenting every epoch's batches on it, and its first epoch held one core busy while the
    # GPU waited (docs/benchmarks.md, "GPU"); the cache then keeps the validation images only
    return True, ("auto: CUDA, JPEGs decoded every epoch on the device"
                  f"{' (the cache keeps the validation images)' if cache else ' (not cached)'}")


def describe(rt: FastPath) -> str:
    cache = ("on (validation only)" if rt.gpu_decode else "on") if rt.cache else "off"
    return (f"cache {cache}, workers {rt.workers}, "
            f"{'bf16 autocast' if rt.amp else 'fp32'}"
            f"{f' ({rt.amp_reason})' if rt.amp_reason else ''}, "
            f"{'channels_last' if rt.channels_last else 'NCHW'}"
            f"{', torch.compile' if rt.compile else ''}"
            f"{', training JPEGs decoded and augmented on the device' if rt.gpu_decode else ''}"
            f"{', one-pixel convolutions as GEMM' if rt.conv_gemm else ''}"
            f"{', JPEGs decoded at reduced size where the crops allow' if rt.dct_scaling else ''}"
            f"{_family_choices(rt)}; "
            f"{rt.cpu.get('kind', 'CPU')}{' (capped)' if rt.cpu.get('isa_cap') else ''}, "
            f"{os.cpu_count()} cores")


def _family_choices(rt: FastPath) -> str:
    """The start-up line's note of the choices `auto` took for the model's family."""
    if not rt.family_choices:
        return ""
    said = ", ".join(f"{c} {why.split(':')[0]}" for c, why in rt.family_choices.items())
    return f" ({said} for {rt.family}: docs/benchmarks.md)"
