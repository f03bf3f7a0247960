"""Names the command line's flags offer, importable without torch (`--help` stays instant).

The augmentation presets, built by trainer/data/transforms.py: "standard" is torchvision's ImageNet
recipe (what the Azure module uses); "light" keeps orientation (digits, text, medical scans);
"none" only resizes, for data already framed like the test images.
"""

AUGMENTATIONS = ("standard", "light", "none")

# The architectures Azure ML designer's ResNet and DenseNet modules offer; trainer/model/arch.py
# builds them with torchvision.
ARCHITECTURES = {
    "resnet": ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d",
               "resnext101_32x8d", "wide_resnet50_2", "wide_resnet101_2"),
    "densenet": ("densenet121", "densenet161", "densenet169", "densenet201"),
}
