"""Training configuration: one dataclass, built once from flags (and optionally a YAML file).

Defaults are those of Azure ML designer's Train PyTorch Model (epochs 5, batch size 16, warmup 0,
learning rate 0.001, seed 1, patience 3, print frequency 10).
"""

import argparse
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from trainer.errors import InvalidParameterError, check_choice, check_range
from trainer.presets import AUGMENTATIONS


@dataclass(frozen=True)
class TrainConfig:
    model: str
    train: str
    val: str
    out: str
    epochs: int = 5
    batch_size: int = 16
    warmup_epochs: int = 0
    lr: float = 0.001
    seed: int = 1
    patience: int = 3
    print_freq: int = 10
    image_size: int = 224
    augment: str = "standard"
    workers: int = -1
    device: str = "auto"
    momentum: float = 0.9
    weight_decay: float = 1e-4
    lr_decay_power: float = 1.0
    cache: str = "auto"
    channels_last: str = "auto"
    amp: str = "auto"
    compile: str = "off"
    gpu_decode: str = "auto"
    conv_gemm: str = "auto"
    dct_scaling: str = "on"
    tensorboard: str = ""  # a folder for TensorBoard event files; "" writes none

    def validate(self) -> "TrainConfig":
        check_range("epochs", self.epochs, 1, 100_000)
        check_range("batch-size", self.batch_size, 1, 65_536)
        check_range("warmup-epochs", self.warmup_epochs, 0, self.epochs)
        check_range("lr", self.lr, 0, 10, low_open=True)
        check_range("seed", self.seed, 0, 2**63 - 1)
        check_range("patience", self.patience, 1, 100_000)
        check_range("print-freq", self.print_freq, 1, 1_000_000)
        check_range("image-size", self.image_size, 32, 2048)
        check_range("workers", self.workers, -1, 128)
        check_range("momentum", self.momentum, 0, 0.999)
        check_range("weight-decay", self.weight_decay, 0, 1)
        check_range("lr-decay-power", self.lr_decay_power, 0, 10)
        check_choice("augment", self.augment, AUGMENTATIONS)
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        check_choice("cache", self.cache, ("auto", "on", "off"))
        check_choice("channels-last", self.channels_last, ("auto", "on", "off"))
        check_choice("amp", self.amp, ("auto", "bf16", "off"))
        check_choice("compile", self.compile, ("on", "off"))
        check_choice("gpu-decode", self.gpu_decode, ("auto", "on", "off"))
        check_choice("conv-gemm", self.conv_gemm, ("auto", "on", "off"))
        check_choice("dct-scaling", self.dct_scaling, ("on", "off"))
        if self.gpu_decode == "on" and self.cache == "on":
            raise InvalidParameterError(
                "--gpu-decode on and --cache on exclude each other: the first decodes the training "
                "JPEGs on the device every epoch, the second keeps them decoded in memory. Pick "
                "one (or leave either at auto).")
        return self

    def to_dict(self) -> dict:
        return asdict(self)


_HELP = {
    "epochs": "number of passes over the training data",
    "batch_size": "images per process per step; the global batch is this x world size",
    "warmup_epochs": "epochs of linear learning-rate warm-up before polynomial decay",
    "lr": "base learning rate of SGD; multiplied by the world size (number of processes)",
    "seed": "random seed; same seed + same world size gives the same model on CPU",
    "patience": "stop after this many epochs without a decrease of the validation loss",
    "print_freq": "print training metrics every this many steps",
    "image_size": "side of the square training crop in pixels",
    "augment": f"training augmentation preset, one of {', '.join(AUGMENTATIONS)}: standard = "
               "random resized crop + horizontal flip (ImageNet recipe), light = mild crops, "
               "no flip (digits, text), none = resize only",
    "workers": "DataLoader worker processes per training process (-1: pick from the cores)",
    "device": "auto (CUDA when available), cpu or cuda",
    "momentum": "SGD momentum",
    "weight_decay": "SGD weight decay (L2)",
    "lr_decay_power": "power of the polynomial decay of the learning rate to 0 at the last epoch",
    "cache": "keep decoded images in memory: on, off, or auto (when they fit in a quarter of the "
             "free memory)",
    "channels_last": "NHWC memory layout: on, off, or auto (on for CUDA and for bf16 on CPU)",
    "amp": "mixed precision: bf16 autocast, off (fp32), or auto (bf16 where the hardware has "
           "native bf16: CUDA, CPUs with AMX)",
    "compile": "torch.compile the model: on or off",
    "gpu_decode": "decode and augment the training JPEGs in batches on the device, workers only "
                  "read files: on, off, or auto (on for CUDA when most training images are JPEGs "
                  "and they are not cached)",
    "conv_gemm": "convolutions whose output is a single pixel (e.g. resnet's last stage on 32 px "
                 "images) run as one matrix multiply, and only the kernel taps that pixel sees "
                 "are trained (the others only multiply padding): on, off, or auto (on for CPU)",
    "dct_scaling": "decode a JPEG at 1/2, 1/4 or 1/8 of its size (libjpeg DCT scaling) when "
                   "what is made of it still only shrinks from there, instead of decoding it "
                   "whole: a training image's random crop (decoded every epoch on the CPU), a "
                   "cached training image (every crop the preset can draw) and a validation "
                   "image's resize: on or off",
    "tensorboard": "write TensorBoard event files of the per-epoch metrics to this folder "
                   "(rank 0; empty: none)",
}


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the training flags (kebab-case, with defaults in the help) to a parser."""
    req = parser.add_argument_group("inputs and output")
    req.add_argument("--model", required=True, help="untrained model directory (kfvision model)")
    req.add_argument("--train", required=True, help="labelled training image directory")
    req.add_argument("--val", required=True, help="labelled validation image directory")
    req.add_argument("--out", required=True, help="output: the trained model directory")
    opt = parser.add_argument_group("training options")
    opt.add_argument("--config", help="YAML file of options (flags given here win)")
    for f in fields(TrainConfig):
        if f.name in ("model", "train", "val", "out"):
            continue
        opt.add_argument("--" + f.name.replace("_", "-"), type=f.type,
                         default=None, metavar=f.name.upper(),
                         help=f"{_HELP[f.name]} (default: {f.default})")
    return parser


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The trainer's parser (`python -m trainer.train`); torch-free, for the command line."""
    parser = argparse.ArgumentParser(
        description="Train a ResNet/DenseNet image classifier with PyTorch DDP.",
        add_help=add_help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return add_train_arguments(parser)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Flags > YAML file (--config) > defaults; validated."""
    values = {}
    if getattr(args, "config", None):
        path = Path(args.config)
        try:
            import yaml  # only for --config: the GPU images have torch but not PyYAML
        except ImportError as e:
            raise InvalidParameterError(
                f"--config {path} needs PyYAML (pip install pyyaml); or give the options as "
                "flags.") from e
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as e:
            raise InvalidParameterError(f"cannot read --config {path}: {e}") from e
        known = {f.name for f in fields(TrainConfig)}
        loaded = {k.replace("-", "_"): v for k, v in loaded.items()}
        unknown = sorted(set(loaded) - known)
        if unknown:
            raise InvalidParameterError(f"{path}: unknown option(s) {', '.join(unknown)}; valid: "
                                        f"{', '.join(sorted(known))}.")
        values.update(loaded)
    for f in fields(TrainConfig):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    for f in fields(TrainConfig):
        if f.type is str and isinstance(values.get(f.name), bool):  # YAML reads on/off as bools
            values[f.name] = "on" if values[f.name] else "off"
        if f.name in values and not isinstance(values[f.name], f.type):
            try:
                values[f.name] = f.type(values[f.name])
            except (TypeError, ValueError) as e:
                raise InvalidParameterError(
                    f"{f.name.replace('_', '-')} = {values[f.name]!r} is not a {f.type.__name__}."
                ) from e
    return TrainConfig(**values).validate()
