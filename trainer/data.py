"""Datasets, transform presets and data loaders over an ImageDirectory.

Samples are uint8 CHW tensors of `image_size`; normalisation happens on the whole batch on the
training device (`Normalizer`), which moves 4x fewer bytes than float32 and costs three passes.

Small datasets are decoded once into memory (`cache`); augmentation then runs on tiny uint8
tensors instead of re-opening and re-decoding files every epoch, and evaluation crops are computed
once. That is most of why `kfvision train` beats an ImageFolder loop on small images.
"""

import functools
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms import v2

from trainer.errors import InvalidDatasetError, check_choice
from trainer.imagedir import ImageDirectory
from trainer.pack import open_pack

# torchvision 0.29 marks its image decoders deprecated in favour of TorchCodec; they remain the
# fastest JPEG path that works on every torchvision we support (0.19+, incl. the GPU images' 0.26).
# Revisit when TorchCodec's image decoding is in every image we run on.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of "
                        "TorchVision are deprecated", category=DeprecationWarning)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# name -> (train transform, eval transform) builders. "standard" is torchvision's ImageNet recipe
# (what the Azure module uses); "light" keeps orientation (digits, text, medical scans); "none" only
# resizes, for data already framed like the test images.
AUGMENTATIONS = ("standard", "light", "none")


def _resize_exact(size):
    return v2.Resize((size, size), antialias=True)


def train_transform(augment: str, size: int):
    check_choice("augment", augment, AUGMENTATIONS)
    if augment == "standard":
        return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])
    if augment == "light":
        return v2.RandomResizedCrop(size, scale=(0.7, 1.0), ratio=(0.85, 1.18), antialias=True)
    return _resize_exact(size)


def eval_transform(augment: str, size: int):
    check_choice("augment", augment, AUGMENTATIONS)
    if augment == "standard":  # resize to size/0.875 then centre crop, as torchvision does
        return v2.Compose([v2.Resize(int(size / 0.875), antialias=True), v2.CenterCrop(size)])
    return _resize_exact(size)


JPEG_SUFFIXES = (".jpg", ".jpeg")


def load_rgb(path) -> torch.Tensor:
    """Any image Pillow reads (grayscale, RGBA, palette, CMYK, 16-bit) as a uint8 RGB CHW tensor.

    JPEGs go through torchvision's libjpeg-turbo decoder straight into a CHW tensor: the same
    pixels as Pillow, without Pillow's image object, mode conversion and two array copies (1.6-1.9x
    the decode + crop rate per core on the benchmark's JPEG set; see docs/benchmarks.md).
    """
    if str(path).lower().endswith(JPEG_SUFFIXES):
        try:
            return decode_jpeg(read_file(str(path)), mode=ImageReadMode.RGB)
        except RuntimeError:
            pass  # not really a JPEG, or a variant libjpeg refuses: Pillow decides below
    with Image.open(path) as im:
        if im.mode.startswith("I"):  # 16/32-bit integer grayscale: scale into 0..255
            arr = np.asarray(im, dtype=np.float64)
            top = 255.0 if arr.max() <= 255 else 65535.0 if arr.max() <= 65535 else arr.max()
            im = Image.fromarray((arr * (255.0 / top)).clip(0, 255).astype(np.uint8), "L")
        rgb = im.convert("RGB")
        arr = np.asarray(rgb, dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


class ImageDataset(Dataset):
    """(uint8 CHW image, label) pairs of an ImageDirectory; label is -1 when unlabelled.

    Args:
        imdir: the image directory.
        transform: applied to each uint8 CHW tensor.
        cache: decode every image once up front and keep it in memory.
        precompute: also apply the (deterministic) transform once up front; for evaluation.
        pack: read the directory's pack (raw pixels, `kfvision pack`) when it has an up-to-date
            one, instead of decoding the image files.
    """

    def __init__(self, imdir: ImageDirectory, transform, *, cache: bool = False,
                 precompute: bool = False, pack: bool = True):
        self.paths = [imdir.root / e.path for e in imdir.images]
        self.labels = [(-1 if e.label is None else e.label) for e in imdir.images]
        self.transform = transform
        self.pack = open_pack(imdir) if pack else None
        self.images = None
        if cache or precompute:
            self.images = [self._decode(i, transform if precompute else None)
                           for i in range(len(self.paths))]
            if precompute:
                self.transform = None

    def _load(self, i) -> torch.Tensor:
        if self.pack is not None:
            return self.pack[i]  # a view of the memory-mapped pixels
        try:
            return load_rgb(self.paths[i])
        except (OSError, ValueError, SyntaxError) as e:  # Pillow's ways of saying "broken"
            raise InvalidDatasetError(
                f"{self.paths[i]} can no longer be decoded ({type(e).__name__}: {e}); it changed "
                "after its image directory was made. Re-create the directory with "
                "`kfvision convert`."
            ) from e

    def _decode(self, i, transform=None):
        img = self._load(i)
        img = transform(img) if transform is not None else img
        return img.clone() if self.pack is not None else img  # kept: own memory, not the file

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = self.images[i] if self.images is not None else self._load(i)
        if self.transform is not None:
            img = self.transform(img)
        return img, self.labels[i]


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
