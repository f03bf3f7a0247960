"""Decoding image files into uint8 RGB CHW tensors, at reduced size where the caller allows.

Every reader of images (training, validation, scoring, packing) decodes through `load_rgb`, and
convert's probe through the Pillow decode it falls back on (trainer/data/rgb.py, torch-free), so
what is accepted is known to reach the model as the same 8-bit RGB pixels.

`--dct-scaling`: libjpeg can decode a JPEG at 1/2, 1/4 or 1/8 of its size for a fraction of the
work (the inverse DCT on fewer coefficients, less upsampling and colour conversion). A caller that
knows what it will make of the image (a random crop, a resize) asks for the smallest decode from
which that still only shrinks (`dct_factor`); the result equals the full decode up to resampling.
"""

import io
import warnings

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms.v2 import functional as F

from kfvision.trainer.data.rgb import pil_rgb
from kfvision.trainer.errors import InvalidDatasetError

# torchvision 0.29 marks its image decoders deprecated in favour of TorchCodec; they remain the
# fastest JPEG path that works on every torchvision we support (0.19+, incl. the GPU images' 0.26).
# Revisit when TorchCodec's image decoding is in every image we run on.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of "
                        "TorchVision are deprecated", category=DeprecationWarning)

JPEG_SUFFIXES = (".jpg", ".jpeg")
# Start-of-frame markers (all JPEG processes; not DHT C4, JPG C8, DAC CC).
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
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
    pixels as Pillow, without Pillow's image object, mode conversion and two array copies.
    `data`: the file's bytes (uint8 tensor), when the caller has read them already; then the
    file is not opened again. `reduce` (2, 4 or 8; with `data` of a JPEG): decode it at that
    fraction of its size (see the module doc), for a caller that shrinks it at least as much.
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
    arr = pil_rgb(path if data is None else io.BytesIO(data.numpy()))
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def dct_factor(box, size: int) -> int:
    """The largest DCT scale-down (8, 4, 2) after which the crop `box` (top, left, height, width)
    is still at least size x size, else 1: decoding at reduced size never upscales the crop."""
    return next((k for k in DCT_FACTORS if min(box[2], box[3]) >= k * size), 1)


def load_rgb_crop(path, data: torch.Tensor, box, size: int) -> torch.Tensor:
    """The crop `box` (top, left, height, width) of the JPEG `data` (the bytes of `path`) resized
    to a size x size uint8 RGB CHW tensor, the JPEG decoded at reduced size where that allows.

    When the crop is at least 2, 4 or 8 times `size` on both sides, the JPEG is decoded at that
    scale (`dct_factor`, `_draft_decode`) and Pillow resizes the crop's box, antialiased as
    torchvision does; otherwise `load_rgb` and torchvision's crop. Same result up to resampling
    (tests/trainer/test_fastpath.py bounds the difference).
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



def decode_file(path, data: torch.Tensor | None = None, reduce: int = 1,
                crop: tuple | None = None) -> torch.Tensor:
    """`load_rgb` (or, with `crop` = (box, size) and the JPEG's `data`, `load_rgb_crop`) of an
    image an image directory lists. A file that no longer decodes raises InvalidDatasetError: it
    was checked when the directory was made, so it changed since."""
    try:
        if crop is not None:
            return load_rgb_crop(path, data, *crop)
        return load_rgb(path, data, reduce)
    except (OSError, ValueError, SyntaxError) as e:  # Pillow's ways of saying "broken"
        raise InvalidDatasetError(
            f"{path} can no longer be decoded ({type(e).__name__}: {e}); it changed after its "
            "image directory was made. Re-create the directory with `kfvision convert`."
        ) from e
