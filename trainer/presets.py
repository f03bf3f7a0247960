"""Names and thresholds the command line's flags offer or state, importable without torch (`--help`
stays instant).

The augmentation presets, built by trainer/data/transforms.py: "standard" is torchvision's ImageNet
recipe (what the Azure module uses); "light" keeps orientation (digits, text, medical scans);
"none" only resizes, for data already framed like the test images.
"""

from kfvision.trainer.errors import check_choice

AUGMENTATIONS = ("standard", "light", "none")

# The normalisation torchvision's ImageNet weights were trained with: kfvision trains with it, and
# assumes it for a model directory a script wrote unless its kfvision.json says otherwise.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# The architectures Azure ML designer's ResNet and DenseNet modules offer; trainer/model/arch.py
# builds them with torchvision.
ARCHITECTURES = {
    "resnet": ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d",
               "resnext101_32x8d", "wide_resnet50_2", "wide_resnet101_2"),
    "densenet": ("densenet121", "densenet161", "densenet169", "densenet201"),
}


def family_of(arch: str) -> str:
    """"resnet" or "densenet" for one of ARCHITECTURES' names; InvalidParameterError naming the
    choices otherwise."""
    for family, names in ARCHITECTURES.items():
        if arch in names:
            return family
    check_choice("model name", arch, [n for names in ARCHITECTURES.values() for n in names])
    raise AssertionError("unreachable")

# The smallest image size at which bf16 autocast + channels_last trains faster than fp32 on a CPU,
# per kind of native bf16 (bench/amp.py; the machines and figures are in docs/benchmarks.md).
# trainer/fastpath.py decides `--amp auto` by them; `--amp`'s help states them.
CPU_BF16_MIN_IMAGE_SIZE = {"AMX": 96, "AVX512_BF16": 64}
