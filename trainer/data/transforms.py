"""The transform presets on uint8 CHW tensors, and the batch normalisation on the device.

Samples stay uint8 until the whole batch is on the training device (`Normalizer`): 4x fewer bytes
move than float32. "standard" is torchvision's ImageNet recipe (what the Azure module uses);
"light" keeps orientation; "none" only resizes (trainer/presets.py names them).
"""

import functools
import math
from dataclasses import dataclass

import torch
from torchvision.transforms import RandomResizedCrop, v2
from torchvision.transforms.v2 import functional as F

from kfvision.trainer.data.decode import dct_factor
from kfvision.trainer.errors import check_choice
from kfvision.trainer.presets import AUGMENTATIONS, IMAGENET_MEAN, IMAGENET_STD

# preset -> (scale, ratio) of its RandomResizedCrop (None: resize the whole image), and whether it
# flips half the images horizontally; torchvision's RandomResizedCrop defaults for "standard".
CROP_PRESETS = {
    "standard": ((0.08, 1.0), (3 / 4, 4 / 3), True),
    "light": ((0.7, 1.0), (0.85, 1.18), False),
    "none": (None, None, False),
}
assert set(CROP_PRESETS) == set(AUGMENTATIONS)


def _resize_exact(size):
    return v2.Resize((size, size), antialias=True)


class TrainCrop:
    """A training preset: a random resized crop (or a plain resize) to size x size, maybe flipped.

    Called on a uint8 CHW tensor it draws the same random numbers and gives the same pixels as
    torchvision's v2 `RandomResizedCrop` (+ `RandomHorizontalFlip`). `draw` takes the random
    decisions from the image's size alone, so a JPEG can be decoded knowing its crop
    (`load_rgb_crop`: at reduced size when the crop shrinks it enough).
    """

    def __init__(self, augment: str, size: int):
        check_choice("augment", augment, AUGMENTATIONS)
        self.size = size
        self.scale, self.ratio, self.flip = CROP_PRESETS[augment]

    def draw(self, height: int, width: int) -> tuple[tuple[int, int, int, int], bool]:
        """((top, left, height, width) of the crop, whether to flip) for an image of that size."""
        if self.scale is None:
            box = (0, 0, height, width)
        else:  # torchvision's sampling; the empty tensor only carries the size
            box = tuple(RandomResizedCrop.get_params(torch.empty(0, height, width),
                                                     list(self.scale), list(self.ratio)))
        return box, bool(self.flip and torch.rand(1).item() < 0.5)

    def decode_factor(self, height: int, width: int) -> int:
        """The DCT scale-down (8, 4, 2, else 1) at which an image of that size can be decoded and
        kept (the cache) so that every crop this preset can draw from it still only shrinks."""
        if self.scale is None:  # the whole image is resized
            return dct_factor((0, 0, height, width), self.size)
        # RandomResizedCrop's crops cover at least scale[0] of the area at an aspect ratio within
        # `ratio`; when it finds none it crops the centre at the nearest allowed ratio, as high
        # or as wide as the image. Either way no side is shorter than `least` (less 1 for rounding).
        aspect = min(self.ratio[0], 1 / self.ratio[1])
        least = min(math.sqrt(self.scale[0] * height * width * aspect), height, width) - 1
        return dct_factor((0, 0, least, least), self.size)

    def apply(self, img: torch.Tensor, box, flip: bool) -> torch.Tensor:
        out = F.resized_crop(img, *box, [self.size, self.size], antialias=True)
        return out.flip(-1) if flip else out

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        return self.apply(img, *self.draw(*img.shape[-2:]))


def train_transform(augment: str, size: int) -> TrainCrop:
    return TrainCrop(augment, size)


class EvalResize:
    """An evaluation preset on uint8 CHW tensors: "standard" resizes the shorter side to
    size / 0.875 and crops the centre size x size, as torchvision does; the others resize to
    size x size.

    `decode_factor` tells how far a JPEG may be scaled down while decoding (`load_rgb`'s
    `reduce`) so that the resize still only shrinks it.
    """

    def __init__(self, augment: str, size: int):
        check_choice("augment", augment, AUGMENTATIONS)
        if augment == "standard":
            self.target = int(size / 0.875)  # both sides end at least this long
            self.ops = v2.Compose([v2.Resize(self.target, antialias=True), v2.CenterCrop(size)])
        else:
            self.target, self.ops = size, _resize_exact(size)

    def decode_factor(self, height: int, width: int) -> int:
        return dct_factor((0, 0, height, width), self.target)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        return self.ops(img)


def eval_transform(augment: str, size: int) -> EvalResize:
    return EvalResize(augment, size)


def kept_size(transform, height: int, width: int) -> tuple[int, int]:
    """The size a cached image of height x width is kept at for `transform` (`decode_factor`'s
    scale, rounded up as libjpeg's DCT scaling does)."""
    k = transform.decode_factor(height, width)
    return -(-height // k), -(-width // k)


@functools.lru_cache(maxsize=8)
def _scale_shift(mean: tuple, std: tuple, device: torch.device):
    """Per-channel (1/(255 std), -mean/std) as (1, C, 1, 1) tensors on the device, made once."""
    std255 = torch.tensor(std, dtype=torch.float64) * 255.0
    scale, shift = 1.0 / std255, -torch.tensor(mean, dtype=torch.float64) * 255.0 / std255
    return tuple(t.float().view(1, -1, 1, 1).to(device) for t in (scale, shift))


@dataclass(frozen=True)
class Normalizer:
    """uint8 NCHW batch on any device -> normalised float batch (optionally channels_last).

    One conversion pass into a fresh NCHW float tensor, then two in-place passes (x * scale +
    shift: (x - mean) / std up to float32 rounding). Batches arrive with channels-last strides
    (decoded and packed images are HWC in memory); broadcasting a per-channel operand over that
    layout is slower on the CPU than the copy to NCHW first (by how much:
    docs/benchmarks.md#why-it-is-faster, "Normalisation").
    """

    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD

    def __call__(self, batch: torch.Tensor, memory_format=torch.contiguous_format) -> torch.Tensor:
        scale, shift = _scale_shift(tuple(self.mean), tuple(self.std), batch.device)
        out = torch.empty(batch.shape, dtype=torch.float32, device=batch.device)
        out.copy_(batch)
        return out.mul_(scale).add_(shift).contiguous(memory_format=memory_format)

