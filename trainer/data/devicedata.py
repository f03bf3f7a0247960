"""Device decoding of the training set (`--gpu-decode`): JPEGs decoded and augmented in batches on
the training device, so DataLoader workers only read files.

On a GPU the CPU-side JPEG decode is what limits a ResNet-50 step (docs/benchmarks.md). Here
workers hand over the encoded bytes; the training process decodes the whole batch with one
`torchvision.io.decode_jpeg(list, device=...)` call (nvJPEG, the hardware decoder on A100/H100),
then crops, resizes and flips the whole batch in a few batched calls (trainer/data/batchcrop.py:
the crop boxes drawn as the `train_transform` presets of trainer/data/transforms.py draw them),
into a uint8 NCHW batch for `Normalizer`. On CUDA a thread makes the batches ahead of the step
(trainer/data/ahead.py).

What the device cannot decode goes to the CPU, per image, never failing the batch:
- files that are not 8-bit grey or colour JPEGs (PNG, CMYK/YCCK or 12-bit JPEG, ...) are decoded
  by `load_rgb` in the worker, as on the CPU path;
- a JPEG the device decoder refuses is decoded by `load_rgb` in the training process.

The same code runs with device "cpu" (libjpeg-turbo), which is how the tests exercise it.
Each image's crop box and flip are drawn by the preset's `TrainCrop.draw` from the image's own
stream (trainer/data/draws.py: keyed by the seed, the epoch and the image), on its full size: the
very crops the CPU path draws, in the CPU path's order; only the resampling differs (roi_align's
box filter against torchvision's triangle filter).
"""

import logging

import torch
from kfvision.trainer.data.ahead import ahead
from kfvision.trainer.data.batchcrop import resized_crops
from kfvision.trainer.data.datasets import ImageDataset, make_loader
from kfvision.trainer.data.decode import jpeg_frame
from kfvision.trainer.data.draws import split_key
from kfvision.trainer.data.imagedir import ImageDirectory
from kfvision.trainer.data.transforms import TrainCrop
from torchvision.io import ImageReadMode, decode_jpeg

log = logging.getLogger("trainer")

def device_decodable(data: torch.Tensor) -> bool:
    """True for an 8-bit JPEG with 1 (grey) or 3 (colour) components: what nvJPEG decodes to RGB.

    Anything else (not a JPEG, CMYK/YCCK, 12-bit, a truncated header) is False and goes to the
    CPU decoder.
    """
    frame = jpeg_frame(data)
    return frame is not None and frame[0] == 8 and frame[3] in (1, 3)


class EncodedImages(ImageDataset):
    """(encoded JPEG bytes or decoded uint8 CHW image, label, key) of an ImageDirectory; the key is
    what it was indexed by (a `Sample` from the training sampler, or a plain index).

    A 1-D uint8 tensor is a JPEG for the device decoder; anything it cannot take arrives decoded
    on the CPU (3-D), with the errors of `ImageDataset` for files that changed on disk.
    """

    def __init__(self, imdir: ImageDirectory):
        super().__init__(imdir, transform=None)

    def __getitem__(self, item):
        i, _ = split_key(item)
        try:
            data = self.read(i)
        except RuntimeError:  # gone or unreadable: _load raises the dataset error that says so
            data = None
        if data is None or not device_decodable(data):
            data = self.load(i)
        return data, self.labels[i], item

    def load(self, i) -> torch.Tensor:
        """Image i decoded on the CPU (`load_rgb`), as the CPU path does."""
        return self._load(i)


def collate_encoded(items):
    """Batch of EncodedImages items -> (all JPEG bytes in one tensor, their lengths (0 for an
    image decoded in the worker), the images decoded in the worker, labels, the items' keys).

    One tensor rather than one per image: a worker hands each tensor over through its own shared
    memory file, and hundreds per batch can run out of file descriptors.
    """
    data, labels, keys = zip(*items)
    jpegs = [d for d in data if d.dim() == 1]
    flat = torch.cat(jpegs) if jpegs else torch.empty(0, dtype=torch.uint8)
    lengths = [d.numel() if d.dim() == 1 else 0 for d in data]
    decoded = [d for d in data if d.dim() != 1]
    return flat, lengths, decoded, torch.tensor(labels), list(keys)


def split_encoded(flat: torch.Tensor, lengths: list, decoded: list) -> list:
    """The batch's images in order: views of `flat` (JPEG bytes) or decoded CHW tensors."""
    jpegs = iter(torch.split(flat, [n for n in lengths if n]))
    others = iter(decoded)
    return [next(jpegs) if n else next(others) for n in lengths]


class DeviceDecodeLoader:
    """Wraps a DataLoader over EncodedImages: yields (uint8 NCHW batch on `device`, labels).

    Args:
        loader: a DataLoader with `collate_encoded` (see `make_device_loader`).
        augment: a kfvision.trainer.presets augmentation name (standard, light, none).
        size: side of the square output images.
        device: where to decode and augment.
        prefetch: make the batches on a thread, ahead of the step (trainer/data/ahead.py);
            None: on CUDA.
    """

    def __init__(self, loader, augment: str, size: int, device, prefetch: bool | None = None):
        self.crop = TrainCrop(augment, size)
        self.loader, self.size, self.device = loader, size, torch.device(device)
        self.prefetch = self.device.type == "cuda" if prefetch is None else prefetch
        self.cpu_fallbacks = 0  # JPEGs the device decoder refused, decoded by load_rgb instead

    def __len__(self):
        return len(self.loader)

    @property
    def dataset(self) -> EncodedImages:
        return self.loader.dataset

    def __iter__(self):
        return ahead(self._batches(), self.device) if self.prefetch else self._batches()

    def _batches(self):
        for flat, lengths, decoded, labels, keys in self.loader:
            images = self.decode(split_encoded(flat, lengths, decoded),
                                 [split_key(k)[0] for k in keys])
            yield self.transform(images, keys), labels

    def decode(self, data: list, indices: list) -> list:
        """Every image of a batch as a uint8 RGB CHW tensor on the device."""
        out = [d.to(self.device, non_blocking=True) if d.dim() == 3 else None for d in data]
        todo = [k for k, d in enumerate(out) if d is None]
        if not todo:
            return out
        try:
            decoded = decode_jpeg([data[k] for k in todo], mode=ImageReadMode.RGB,
                                  device=self.device)
        except RuntimeError:  # one image spoils the batched call: find it, decode the rest
            decoded = [self._decode_one(data[k], indices[k]) for k in todo]
        for k, img in zip(todo, decoded):
            out[k] = img
        return out

    def _decode_one(self, data: torch.Tensor, index: int) -> torch.Tensor:
        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError as e:
            self.cpu_fallbacks += 1
            if self.cpu_fallbacks == 1:
                log.warning("the %s JPEG decoder refused %s (%s); decoding such images on the "
                            "CPU", self.device.type, self.dataset.paths[index], e)
            return self.dataset.load(index).to(self.device, non_blocking=True)

    def transform(self, images: list, keys: list) -> torch.Tensor:
        """The preset's crop + resize (+ flip) of the whole batch (trainer/data/batchcrop.py),
        each image's box and flip drawn on the CPU from its key's stream (`split_key`)."""
        draws = [self.crop.draw(*(int(s) for s in img.shape[-2:]), split_key(k)[1])
                 for img, k in zip(images, keys)]
        boxes, flips = zip(*draws)
        return resized_crops(images, list(boxes), self.size, list(flips) if any(flips) else None)


def make_device_loader(dataset: EncodedImages, *, augment: str, image_size: int, device,
                       prefetch: bool | None = None, **loader_options):
    """`make_loader` over encoded images, wrapped to decode and augment on `device` (`prefetch`:
    see DeviceDecodeLoader).

    Returns (DeviceDecodeLoader, sampler or None) like `make_loader`.
    """
    loader, sampler = make_loader(dataset, collate_fn=collate_encoded, **loader_options)
    return DeviceDecodeLoader(loader, augment, image_size, device, prefetch), sampler
