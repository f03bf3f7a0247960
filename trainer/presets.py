"""Names and thresholds the command line's flags offer or state, importable without torch (`--help`
stays instant).

The augmentation presets, built by trainer/data/transforms.py: "standard" is torchvision's ImageNet
recipe (what the Azure module uses); "light" keeps orientation (digits, text, medical scans);
"none" only resizes, for data already framed like the test images.
"""

import difflib

from kfvision.trainer.errors import InvalidParameterError
from kfvision.trainer.model.catalog import FAMILIES

AUGMENTATIONS = ("standard", "light", "none")  # the data pipeline's presets
# and "strong": standard, then TrivialAugment and random erasing on the batch (trainer/recipes.py)
TRAIN_AUGMENTATIONS = ("standard", "strong", "light", "none")
OPTIMIZERS = ("sgd", "adamw")
LR_SCHEDULES = ("poly", "cosine")

# The training recipes: what each option left unset (None) takes (TrainConfig.resolved). azure is
# today's module (SGD, warm-up then polynomial decay, nothing else); finetune adapts pretrained
# weights gently; torchvision follows torchvision's references/classification (its "new recipe":
# label smoothing, mixup, cutmix, EMA, TrivialAugment, random erasing, cosine, no weight decay on
# norms), with --lr, --weight-decay and --epochs still the user's.
_OFF = {"label_smoothing": 0.0, "mixup_alpha": 0.0, "cutmix_alpha": 0.0, "ema_decay": 0.0,
        "freeze_backbone_epochs": 0}
RECIPES = {
    "azure": {"optimizer": "sgd", "lr_schedule": "poly", **_OFF, "norm_weight_decay": None,
              "augment": "standard"},
    "finetune": {"optimizer": "adamw", "lr_schedule": "cosine", **_OFF, "label_smoothing": 0.1,
                 "freeze_backbone_epochs": 1, "norm_weight_decay": 0.0, "augment": "standard"},
    "torchvision": {"optimizer": "sgd", "lr_schedule": "cosine", "label_smoothing": 0.1,
                    "mixup_alpha": 0.2, "cutmix_alpha": 1.0, "ema_decay": 0.9998,
                    "freeze_backbone_epochs": 0, "norm_weight_decay": 0.0, "augment": "strong"},
}

# The normalisation torchvision's ImageNet weights were trained with: kfvision trains with it, and
# assumes it for a model directory a script wrote unless its kfvision.json says otherwise.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Every classification model of torchvision, by family (the module that builds it), generated
# from torchvision's own list (trainer/model/catalog.py; trainer/model/arch.py builds them). Azure
# ML designer's ResNet and DenseNet modules offer the "resnet" and "densenet" families.
ARCHITECTURES = FAMILIES


def family_of(arch: str) -> str:
    """The family ("resnet", "vision_transformer", ...) of one of ARCHITECTURES' names;
    InvalidParameterError naming the closest names (and where the others are) otherwise."""
    for family, names in ARCHITECTURES.items():
        if arch in names:
            return family
    every = [n for names in ARCHITECTURES.values() for n in names]
    close = difflib.get_close_matches(str(arch), every, n=5, cutoff=0.5)
    raise InvalidParameterError(
        f"model name {arch!r} is not one of torchvision's {len(every)} classification models"
        f"{' (closest: ' + ', '.join(close) + ')' if close else ''}; docs/models.md lists "
        "them by family.")


# The smallest image size at which bf16 autocast + channels_last trains faster than fp32 on a CPU,
# per kind of native bf16 (bench/amp.py; the machines and figures are in docs/benchmarks.md).
# trainer/fastpath.py decides `--amp auto` by them; `--amp`'s help states them.
CPU_BF16_MIN_IMAGE_SIZE = {"AMX": 96, "AVX512_BF16": 64}
