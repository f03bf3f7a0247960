"""Datasets, transform presets and data loaders over an ImageDirectory.

Samples are uint8 CHW tensors of `image_size`; normalisation happens on the whole batch on the
training device (`Normalizer`), which moves 4x fewer bytes than float32 and costs three passes.

Small datasets are decoded once into memory (`cache`); augmentation then runs on tiny uint8
tensors instead of re-opening and re-decoding files every epoch, and evaluation crops are computed
once. That is most of why `kfvision train` beats an ImageFolder loop on small images.
"""

import functools
import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms import RandomResizedCrop, v2
from torchvision.transforms.v2 import functional as F

from trainer.errors import InvalidDatasetError, check_choice
from trainer.imagedir import ImageDirectory
from trainer.pack import INDEX, open_pack
from trainer.presets import AUGMENTATIONS  # also imported from here

# torchvision 0.29 marks its image decoders deprecated in favour of TorchCodec; they remain the
# fastest JPEG path that works on every torchvision we support (0.19+, incl. the GPU images' 0.26).
# Revisit when TorchCodec's image decoding is in every image we run on.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of "
                        "TorchVision are deprecated", category=DeprecationWarning)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


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


JPEG_SUFFIXES = (".jpg", ".jpeg")
# Start-of-frame markers (all JPEG processes; not DHT C4, JPG C8, DAC CC).
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
# libjpeg's DCT scaling: a JPEG decodes at 1/8, 1/4 or 1/2 of its size for a fraction of the work
DCT_FACTORS = (8, 4, 2)


def jpeg_frame(data: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(bits per sample, height, width, components) from a JPEG's frame header.

    Reads the marker segments up to the frame header; None when `data` (a file's bytes as a 1-D
    uint8 tensor) is not a JPEG, is truncated before the header, or has image data first.
    """
    b = memoryview(data.numpy())
    if len(b) < 4 or b[0] != 0xFF or b[1] != 0xD8:
        return None
    pos = 2
    while pos + 4 <= len(b):
        if b[pos] != 0xFF:
            return None
        marker = b[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # segments without a length
            pos += 2
            continue
        if marker in _SOF:
            if pos + 10 > len(b):
                return None
            return (b[pos + 4], b[pos + 5] << 8 | b[pos + 6], b[pos + 7] << 8 | b[pos + 8],
                    b[pos + 9])
        if marker == 0xDA:  # image data before any frame header
            return None
        pos += 2 + (b[pos + 2] << 8 | b[pos + 3])
    return None


def _draft_decode(data: torch.Tensor, factor: int) -> tuple[Image.Image, tuple] | None:
    """(RGB Pillow image, full (width, height)): the JPEG `data` decoded by libjpeg at 1/factor of
    its size (Pillow's `draft`: the inverse DCT on fewer coefficients, less upsampling and colour
    conversion); None when Pillow cannot decode it at reduced size."""
    try:
        im = Image.open(io.BytesIO(data.numpy()))  # in memory: no file to close; loaded below
        full = im.size
        im.draft(None, (full[0] // factor, full[1] // factor))
        if im.size == full:
            return None
        im.load()
        return (im if im.mode == "RGB" else im.convert("RGB")), full
    except (OSError, ValueError, SyntaxError):
        return None  # Pillow refuses it: the full decode decides (and says what is wrong)


def load_rgb(path, data: torch.Tensor | None = None, reduce: int = 1) -> torch.Tensor:
    """Any image Pillow reads (grayscale, RGBA, palette, CMYK, 16-bit) as a uint8 RGB CHW tensor.

    JPEGs go through torchvision's libjpeg-turbo decoder straight into a CHW tensor: the same
    pixels as Pillow, without Pillow's image object, mode conversion and two array copies (1.6-1.9x
    the decode + crop rate per core on the benchmark's JPEG set; see docs/benchmarks.md).
    `data`: the file's bytes (uint8 tensor), when the caller has read them already; then the
    file is not opened again. `reduce` (2, 4 or 8; with `data` of a JPEG): decode it at that
    fraction of its size (libjpeg DCT scaling), for a caller that shrinks it at least as much.
    """
    if reduce > 1 and data is not None:
        reduced = _draft_decode(data, reduce)
        if reduced is not None:
            return torch.from_numpy(np.asarray(reduced[0]).copy()).permute(2, 0, 1)
    if str(path).lower().endswith(JPEG_SUFFIXES):
        try:
            return decode_jpeg(read_file(str(path)) if data is None else data,
                               mode=ImageReadMode.RGB)
        except RuntimeError:
            pass  # not really a JPEG, or a variant libjpeg refuses: Pillow decides below
    with Image.open(path if data is None else io.BytesIO(data.numpy())) as im:
        if im.mode.startswith("I"):  # 16/32-bit integer grayscale: scale into 0..255
            arr = np.asarray(im, dtype=np.float64)
            top = 255.0 if arr.max() <= 255 else 65535.0 if arr.max() <= 65535 else arr.max()
            im = Image.fromarray((arr * (255.0 / top)).clip(0, 255).astype(np.uint8), "L")
        rgb = im.convert("RGB")
        arr = np.asarray(rgb, dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


def dct_factor(box, size: int) -> int:
    """The largest DCT scale-down (8, 4, 2) after which the crop `box` (top, left, height, width)
    is still at least size x size, else 1: decoding at reduced size never upscales the crop."""
    return next((k for k in DCT_FACTORS if min(box[2], box[3]) >= k * size), 1)


def load_rgb_crop(path, data: torch.Tensor, box, size: int) -> torch.Tensor:
    """The crop `box` (top, left, height, width) of the JPEG `data` (the bytes of `path`) resized
    to a size x size uint8 RGB CHW tensor, the JPEG decoded at reduced size where that allows.

    When the crop is at least 2, 4 or 8 times `size` on both sides, libjpeg decodes the image at
    1/2, 1/4 or 1/8 of its size (Pillow's `draft`: the inverse DCT on fewer coefficients, less
    upsampling and colour conversion, and a smaller image to shrink); then Pillow resizes the
    crop's box, antialiased as torchvision does. A 12-megapixel photo's 224 px crop costs about
    half of a full decode (docs/benchmarks.md). Otherwise: `load_rgb` and torchvision's crop.
    Same result up to resampling (tests/test_fastpath.py bounds the difference).
    """
    factor = dct_factor(box, size)
    reduced = _draft_decode(data, factor) if factor > 1 else None
    if reduced is not None:
        rgb, (width, height) = reduced
        sx, sy = rgb.width / width, rgb.height / height
        top, left, h, w = box
        out = rgb.resize((size, size), Image.Resampling.BILINEAR,
                         box=(left * sx, top * sy, (left + w) * sx, (top + h) * sy))
        return torch.from_numpy(np.asarray(out).copy()).permute(2, 0, 1)
    return F.resized_crop(load_rgb(path, data), *box, [size, size], antialias=True)


def kept_size(transform, height: int, width: int) -> tuple[int, int]:
    """The size a cached image of height x width is kept at for `transform` (`decode_factor`'s
    scale, rounded up as libjpeg's DCT scaling does)."""
    k = transform.decode_factor(height, width)
    return -(-height // k), -(-width // k)


def cache_bytes(imdir: ImageDirectory, transform, dct_scaling: bool) -> int:
    """RGB bytes that caching `imdir`'s images for `transform` takes (to decide whether to cache).

    With `dct_scaling` and a `TrainCrop`, every image is kept at `kept_size` (JPEGs decoded at
    that scale, others resized to it); at full size otherwise, and whenever a pack is there (the
    cache then copies its full-size pixels).
    """
    if not (dct_scaling and isinstance(transform, TrainCrop)) or (imdir.root / INDEX).exists():
        return imdir.decoded_bytes()
    return sum(math.prod(kept_size(transform, e.height, e.width)) * 3 for e in imdir.images)


class ImageDataset(Dataset):
    """(uint8 CHW image, label) pairs of an ImageDirectory; label is -1 when unlabelled.

    Args:
        imdir: the image directory.
        transform: applied to each uint8 CHW tensor.
        cache: decode every image once up front and keep it in memory.
        precompute: also apply the (deterministic) transform once up front; for evaluation.
        pack: read the directory's pack (raw pixels, `kfvision pack`) when it has an up-to-date
            one, instead of decoding the image files.
        dct_scaling: decode each JPEG knowing what the transform makes of it, at reduced size
            where that still only shrinks it: a `TrainCrop`'s random crop (`load_rgb_crop`) when
            decoded every epoch; with `cache`, at the scale every crop the preset can draw
            allows (`TrainCrop.decode_factor`); an `EvalResize`'s resize, also when
            precomputed. Never for a pack, which holds the full-size pixels.
    """

    def __init__(self, imdir: ImageDirectory, transform, *, cache: bool = False,
                 precompute: bool = False, pack: bool = True, dct_scaling: bool = False):
        self.paths = [imdir.root / e.path for e in imdir.images]
        self.labels = [(-1 if e.label is None else e.label) for e in imdir.images]
        self.transform = transform
        self.pack = open_pack(imdir) if pack else None
        self.dct_scaling = (dct_scaling and self.pack is None
                            and isinstance(transform, (TrainCrop, EvalResize)))
        self.images = None
        if cache or precompute:
            self.images = [self._decode(i, transform if precompute else None)
                           for i in range(len(self.paths))]
            if precompute:
                self.transform = None

    def _load(self, i, crop=None, data=None, reduce: int = 1) -> torch.Tensor:
        """Image i; with `crop` = (JPEG bytes, box, size), its crop (`load_rgb_crop`); `data`:
        its file's bytes, already read; `reduce`: see `load_rgb`."""
        if self.pack is not None:
            return self.pack[i]  # a view of the memory-mapped pixels
        try:
            if crop is not None:
                return load_rgb_crop(self.paths[i], *crop)
            return load_rgb(self.paths[i], data, reduce)
        except (OSError, ValueError, SyntaxError) as e:  # Pillow's ways of saying "broken"
            raise InvalidDatasetError(
                f"{self.paths[i]} can no longer be decoded ({type(e).__name__}: {e}); it changed "
                "after its image directory was made. Re-create the directory with "
                "`kfvision convert`."
            ) from e

    def decode_bytes(self, i, data: torch.Tensor) -> torch.Tensor:
        """Image i (uint8 RGB CHW, untransformed) from its file's bytes, read by the caller."""
        return self._load(i, data=data)

    def _decode(self, i, transform=None):
        if self.dct_scaling:  # cached training images, or precomputed evaluation images
            if transform is None:
                return self._decode_for(i, self.transform, apply=False)
            return self._decode_for(i, transform)
        img = self._load(i)
        img = transform(img) if transform is not None else img
        return img.clone() if self.pack is not None else img  # kept: own memory, not the file

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        if self.images is None and self.dct_scaling:
            return self._decode_for(i, self.transform), self.labels[i]
        img = self.images[i] if self.images is not None else self._load(i)
        if self.transform is not None:
            img = self.transform(img)
        return img, self.labels[i]

    def _decode_for(self, i, transform, apply: bool = True) -> torch.Tensor:
        """`transform` of image i (or, not `apply`, the image to keep for it), the JPEG decoded
        knowing the output from its header's size: a TrainCrop's crop is drawn first; otherwise
        the decode is scaled down as far as `transform.decode_factor` allows. An image kept is
        always at that scale (`kept_size`), whatever its format: `cache_bytes` counts on it."""
        path = self.paths[i]
        frame = None
        if str(path).lower().endswith(JPEG_SUFFIXES):
            try:
                data = read_file(str(path))
                frame = jpeg_frame(data)
            except RuntimeError:
                pass  # unreadable: _load below says so
        if frame is None or 0 in frame[1:3]:  # not a JPEG after all, or no height in the header
            img = self._load(i)
            full = tuple(img.shape[-2:])
        elif apply and isinstance(transform, TrainCrop):
            box, flip = transform.draw(frame[1], frame[2])
            img = self._load(i, (data, box, transform.size))
            return img.flip(-1) if flip else img
        else:
            full = frame[1:3]
            img = self._load(i, data=data, reduce=transform.decode_factor(*full))
        if apply:
            return transform(img)
        size = kept_size(transform, *full)
        return img if img.shape[-2:] == size else F.resize(img, list(size), antialias=True)


class EvalShard(Dataset):
    """Every world_size-th item from rank on: each image evaluated exactly once across ranks
    (DistributedSampler would pad with repeats and skew the metrics)."""

    def __init__(self, base: Dataset, rank: int, world_size: int):
        self.base, self.indices = base, range(rank, len(base), world_size)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        return self.base[self.indices[i]]


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
    layout is 5-6x slower on the CPU than the copy to NCHW first (docs/benchmarks.md).
    """

    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD

    def __call__(self, batch: torch.Tensor, memory_format=torch.contiguous_format) -> torch.Tensor:
        scale, shift = _scale_shift(tuple(self.mean), tuple(self.std), batch.device)
        out = torch.empty(batch.shape, dtype=torch.float32, device=batch.device)
        out.copy_(batch)
        return out.mul_(scale).add_(shift).contiguous(memory_format=memory_format)


def _seed_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's generator; numpy/random follow that seed so any
    # user transform that uses them is reproducible too.
    import random

    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def make_loader(dataset: Dataset, *, batch_size: int, workers: int, shuffle: bool, seed: int,
                rank: int = 0, world_size: int = 1, pin_memory: bool = False,
                drop_last: bool = False, collate_fn=None):
    """A DataLoader; with world_size > 1 and shuffle, a seeded DistributedSampler (returned too,
    so the caller can `set_epoch`). `collate_fn`: None for the default (stacked tensors)."""
    sampler = None
    if shuffle and world_size > 1:
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=seed, drop_last=drop_last)
    generator = torch.Generator().manual_seed(seed + rank)
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle and sampler is None, sampler=sampler,
        num_workers=workers, pin_memory=pin_memory, drop_last=drop_last, generator=generator,
        worker_init_fn=_seed_worker if workers else None, collate_fn=collate_fn,
        persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
    )
    return loader, sampler
