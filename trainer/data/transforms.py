"""The transform presets on uint8 CHW tensors, and the batch normalisation on the device.

Samples stay uint8 until the whole batch is on the training device (`Normalizer`): 4x fewer bytes
move than float32. "standard" is torchvision's ImageNet recipe (what the Azure module uses);
"light" keeps orientation; "none" only resizes (trainer/presets.py names them).
"""

import functools
import math
from dataclasses import dataclass

import torch
from kfvision.trainer.data.decode import dct_factor
from kfvision.trainer.data.draws import GlobalStream
from kfvision.trainer.errors import check_choice
from kfvision.trainer.presets import AUGMENTATIONS, IMAGENET_MEAN, IMAGENET_STD
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

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

    The crop is drawn as torchvision's `RandomResizedCrop.get_params` draws it (up to 10 tries of
    an area fraction in `scale` and a log-uniform aspect ratio in `ratio`, else the centre crop at
    the nearest allowed ratio), and cut and resized as its v2 functional `resized_crop` does; the
    random numbers come from the generator given (trainer/data/draws.py: one stream per image and
    epoch), all of them in one call. `draw` takes the decisions from the image's size alone, so a
    JPEG can be decoded knowing its crop (`load_rgb_crop`: at reduced size when the crop shrinks
    it enough), and `--gpu-decode` draws the very same crops (trainer/data/devicedata.py).
    """

    ATTEMPTS = 10  # torchvision's

    def __init__(self, augment: str, size: int):
        check_choice("augment", augment, AUGMENTATIONS)
        self.size = size
        self.scale, self.ratio, self.flip = CROP_PRESETS[augment]

    def draw(self, height: int, width: int, stream=None) -> tuple[tuple[int, int, int, int], bool]:
        """((top, left, height, width) of the crop, whether to flip) for an image of that size,
        drawn from `stream` (trainer/data/draws.py; None: torch's global generator): the flip's
        number first, then 4 for each try of the crop."""
        stream = stream or GlobalStream()
        first = stream.uniforms(5)
        flip = bool(self.flip and first[0] < 0.5)
        if self.scale is None:
            return (0, 0, height, width), flip
        return random_resized_box(height, width, self.scale, self.ratio, first[1:], stream), flip

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

    def __call__(self, img: torch.Tensor, stream=None) -> torch.Tensor:
        return self.apply(img, *self.draw(*img.shape[-2:], stream))


def random_resized_box(height: int, width: int, scale, ratio, first: list, stream,
                       attempts: int = TrainCrop.ATTEMPTS) -> tuple:
    """(top, left, height, width): torchvision's RandomResizedCrop.get_params for an image of
    that size, the first try's 4 uniforms `first`, the others' read from `stream` as needed."""
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for attempt in range(attempts):
        u_area, u_ratio, u_top, u_left = first if attempt == 0 else stream.uniforms(4)
        area = height * width * (scale[0] + u_area * (scale[1] - scale[0]))
        aspect = math.exp(log_lo + u_ratio * (log_hi - log_lo))
        w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(u_top * (height - h + 1)), int(u_left * (width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def scale_box(box, full: tuple, kept: tuple) -> tuple:
    """A crop box drawn on an image of size `full`, for the same image kept at size `kept` (the
    cache holds large JPEGs decoded at reduced size: the same crop, fewer pixels)."""
    if tuple(full) == tuple(kept):
        return box
    top, left, h, w = box
    sy, sx = kept[0] / full[0], kept[1] / full[1]
    t, lft = min(round(top * sy), kept[0] - 1), min(round(left * sx), kept[1] - 1)
    return (t, lft, max(1, min(round((top + h) * sy), kept[0]) - t),
            max(1, min(round((left + w) * sx), kept[1]) - lft))


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

