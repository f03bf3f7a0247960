"""The augmentation presets' names, importable without torch (the command line's flags need them).

trainer/data.py builds them: "standard" is torchvision's ImageNet recipe (what the Azure module
uses); "light" keeps orientation (digits, text, medical scans); "none" only resizes, for data
already framed like the test images.
"""

AUGMENTATIONS = ("standard", "light", "none")
