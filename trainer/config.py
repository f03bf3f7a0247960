"""Training configuration: one dataclass, built once from flags (and optionally a YAML file).

The options' defaults are those of Azure ML designer's Train PyTorch Model; the options are
declared once, as TrainConfig's fields (see trainer/options.py).
"""

import argparse
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from kfvision.trainer.errors import InvalidParameterError, ref
from kfvision.trainer.options import (
    ArgumentParser,
    HelpFormatter,
    add_flags,
    check_options,
    option,
    options_of,
)
from kfvision.trainer.presets import (
    CPU_BF16_MIN_IMAGE_SIZE,
    LR_SCHEDULES,
    OPTIMIZERS,
    RECIPES,
    TRAIN_AUGMENTATIONS,
)

ON_OFF = ("on", "off")
AUTO_ON_OFF = ("auto", "on", "off")
_RECIPE = "the recipe's"
_BF16_FROM = ", ".join(f"{kind} from {px} px" for kind, px in CPU_BF16_MIN_IMAGE_SIZE.items())


@dataclass(frozen=True)
class TrainConfig:
    """The training run's configuration: the four paths, then the options (each declared once
    here: flags, checks and the pipeline's parameters come from these fields)."""

    model: str
    train: str
    val: str
    out: str
    epochs: int = option(5, "number of passes over the training data", low=1, high=100_000,
                         pipeline=True)
    batch_size: int = option(16, "images per process per step; the global batch is this x "
                             "world size", low=1, high=65_536, pipeline=True)
    warmup_epochs: int = option(0, "epochs of linear learning-rate warm-up before polynomial "
                                "decay", low=0, high="epochs", pipeline=True)
    lr: float = option(0.001, "base learning rate of SGD; multiplied by the world size (number "
                       "of processes)", low=0, high=10, low_open=True, pipeline="learning_rate")
    seed: int = option(1, "random seed", doc="The same seed and world size give the same model "
                       "on CPU, whatever the workers, cache or storage (docs/data.md, \"What a "
                       "run's result depends on\"); the pipeline's split uses it too.", low=0,
                       high=2**63 - 1, pipeline="random_seed")
    patience: int = option(3, "stop after this many epochs without a decrease of the validation "
                           "loss", low=1, high=100_000, pipeline=True)
    print_freq: int = option(10, "print training metrics every this many steps", low=1,
                             high=1_000_000, pipeline="print_frequency")
    image_size: int = option(224, "side of the square training crop in pixels", low=32,
                             high=2048, pipeline=True)
    augment: str | None = option(None, "training augmentation preset", doc="standard: random "
                                 "resized crop + horizontal flip (ImageNet recipe); strong: "
                                 "standard, then TrivialAugment and random erasing (p 0.1) per "
                                 "image; light: mild crops, no flip (digits, text); none: resize "
                                 "only.", choices=TRAIN_AUGMENTATIONS, unset=_RECIPE,
                                 pipeline=True)
    recipe: str = option("azure", "a group of the training recipe's options",
                         doc="What each option marked 'the recipe's' takes unless given: "
                         + "; ".join(f"{r}: " + ", ".join(f"{k} {v}" for k, v in vals.items())
                                     for r, vals in RECIPES.items())
                         + ". azure is Azure ML designer's module; finetune adapts pretrained "
                         "weights; torchvision is the recipe of torchvision's references "
                         "(docs/models.md#recipes).", choices=tuple(RECIPES), pipeline=True)
    optimizer: str | None = option(None, "optimizer: sgd (with momentum) or adamw",
                                   choices=OPTIMIZERS, unset=_RECIPE, pipeline=True)
    lr_schedule: str | None = option(None, "after warm-up: poly(nomial) or cosine decay to 0",
                                     choices=LR_SCHEDULES, unset=_RECIPE, pipeline=True)
    label_smoothing: float | None = option(None, "label smoothing of the loss", low=0.0,
                                           high=0.5, unset=_RECIPE, pipeline=True)
    mixup_alpha: float | None = option(None, "mixup's Beta(alpha, alpha) (0: off)", low=0.0,
                                       high=10.0, unset=_RECIPE, pipeline=True)
    cutmix_alpha: float | None = option(None, "cutmix's Beta(alpha, alpha) (0: off)", low=0.0,
                                        high=10.0, unset=_RECIPE, pipeline=True,
                                        doc="With mixup too, each batch takes one of the two.")
    ema_decay: float | None = option(None, "decay of an exponential moving average of the "
                                     "weights per step (0: off)", low=0.0, high=0.999999,
                                     unset=_RECIPE, pipeline=True,
                                     doc="Validated every epoch beside the weights; the better "
                                     "of the two (validation loss) is the output.")
    freeze_backbone_epochs: int | None = option(None, "epochs in which only the classifier "
                                                "head trains", low=0, high="epochs",
                                                unset=_RECIPE, pipeline=True)
    norm_weight_decay: float | None = option(None, "weight decay of norm layers and biases",
                                             low=0.0, high=1.0, unset=_RECIPE, pipeline=True,
                                             doc="None (azure): --weight-decay, as every other "
                                             "weight.")
    workers: int = option(-1, "DataLoader worker processes per training process (-1: pick from "
                          "the cores)", low=-1, high=128)
    device: str = option("auto", "auto (CUDA when available), cpu or cuda",
                         choices=("auto", "cpu", "cuda"))
    momentum: float = option(0.9, "SGD momentum (adamw: beta1 stays 0.9)", low=0, high=0.999)
    weight_decay: float = option(1e-4, "weight decay (SGD: L2; adamw: decoupled)", low=0,
                                 high=1)
    lr_decay_power: float = option(1.0, "power of the polynomial decay of the learning rate to "
                                   "0 at the last epoch", low=0, high=10)
    cache: str = option("auto", "keep decoded images in memory", doc="auto: when they fit in a "
                        "quarter of the free memory. Decoded before epoch 1 on every core the "
                        "process has (a progress bar on a terminal).", choices=AUTO_ON_OFF)
    channels_last: str = option("auto", "NHWC memory layout: on, off, or auto (on for CUDA and "
                                "for bf16 on CPU)", doc="auto: and as measured for the families "
                                "docs/benchmarks.md names (\"The fast path per family\").",
                                choices=AUTO_ON_OFF)
    amp: str = option("auto", "mixed precision: bf16 autocast, or off (fp32)", doc="auto: bf16 "
                      "where the hardware has native bf16 and it pays: CUDA; CPUs with "
                      f"{_BF16_FROM}, except where measured otherwise for a family "
                      "(docs/benchmarks.md, "
                      "\"The fast path per family\"); the start-up line says why.",
                      choices=("auto", "bf16", "off"))
    compile: str = option("off", "torch.compile the model: on or off", choices=ON_OFF)
    gpu_decode: str = option("auto", "decode and augment the training JPEGs on the device",
                             doc="nvJPEG decodes each batch, which is then cropped, resized and "
                             "flipped as a whole on the device; the workers only read files. "
                             "auto: on for CUDA when most training images are JPEGs, cached or "
                             "not (the cache then keeps the validation images); metrics.json's "
                             "`fast_path` says which and why.",
                             choices=AUTO_ON_OFF)
    conv_gemm: str = option("auto", "one-pixel convolutions as one matrix multiply",
                            doc="Convolutions whose output is a single pixel (e.g. resnet's last "
                            "stage on 32 px images) run as one matrix multiply, and only the "
                            "kernel taps that pixel sees are trained (the others only multiply "
                            "padding). auto: on for CPU, except where measured otherwise "
                            "for a family (docs/benchmarks.md, \"The fast path per family\").",
                            choices=AUTO_ON_OFF)
    dct_scaling: str = option("on", "decode JPEGs at 1/2, 1/4 or 1/8 size where that suffices",
                              doc="libjpeg DCT scaling, when what is made of the image still "
                              "only shrinks from there, instead of decoding it whole: a training "
                              "image's random crop (decoded every epoch on the CPU), a cached "
                              "training image (every crop the preset can draw) and a validation "
                              "image's resize.", choices=ON_OFF)
    checkpoint_dir: str | None = option(None, "folder of the per-epoch checkpoints a restarted "
                                        "run resumes from", metavar="DIR", unset="OUT/checkpoints",
                                        doc="An s3:// URI in a job: the node agent keeps them "
                                        "there.")
    tensorboard: str | None = option(None, "write TensorBoard event files of the per-epoch "
                                     "metrics to this folder (rank 0)", metavar="DIR",
                                     unset="none")
    tracking_uri: str | None = option(None, "MLflow server (or local store) rank 0 logs to",
                                      doc="E.g. http://mlflow:5000, or a local store such as "
                                      "sqlite:///PATH/mlflow.db (docs/tracking.md).",
                                      metavar="URI", unset="MLFLOW_TRACKING_URI, else off")
    experiment: str | None = option(None, "MLflow experiment of a new run", doc="MLFLOW_"
                                    "EXPERIMENT_ID wins; MLFLOW_RUN_ID logs into that run.",
                                    metavar="NAME",
                                    unset="MLFLOW_EXPERIMENT_NAME, else kfvision")

    def validate(self) -> "TrainConfig":
        """Raise InvalidParameterError for an option out of range, not one of its choices, or
        excluded by another."""
        check_options(self)
        if self.gpu_decode == "on" and self.cache == "on":
            raise InvalidParameterError(
                f"{ref('gpu_decode')} on and {ref('cache')} on exclude each other: the first "
                "decodes the training JPEGs on the device every epoch, the second keeps them "
                "decoded in memory. Pick one (or leave either at auto).")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    def resolved(self) -> "TrainConfig":
        """This configuration with every option left to the recipe (None) set from it."""
        group = RECIPES[self.recipe]
        return replace(self, **{k: v for k, v in group.items() if getattr(self, k) is None})


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the training flags (kebab-case, with defaults in the help) to a parser."""
    req = parser.add_argument_group("inputs and output")
    req.add_argument("--model", required=True, help="untrained model directory (kfvision model)")
    req.add_argument("--train", required=True, help="labelled training image directory")
    req.add_argument("--val", required=True, help="labelled validation image directory")
    req.add_argument("--out", required=True, help="output: the trained model directory")
    opt = parser.add_argument_group("training options")
    opt.add_argument("--config", help="YAML file of options (flags given here win)")
    add_flags(opt, options_of(TrainConfig), defaults=False)  # None: not given, see --config
    return parser


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The trainer's parser (`python -m kfvision.trainer.train`); torch-free, for the command
    line."""
    parser = ArgumentParser(
        prog="python -m kfvision.trainer.train",
        description="Train a torchvision image classifier with PyTorch DDP.",
        add_help=add_help, formatter_class=HelpFormatter)
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
                    f"{ref(f.name)} = {values[f.name]!r} is not a {f.type.__name__}.") from e
    return TrainConfig(**values).validate()
