"""Any image Pillow reads as 8-bit RGB pixels, with numpy and Pillow alone.

`kfvision convert` checks every image with `pil_rgb` without importing torch (a conversion, or a
pipeline's convert step, starts 2 s sooner); trainer/data/decode.py `load_rgb` decodes through the
same function whatever libjpeg-turbo does not, so what convert accepts reaches the model as the
same pixels.
"""

import numpy as np
from PIL import Image


def pil_rgb(fp) -> np.ndarray:
    """The image in `fp` (a path or a binary file object) as a writable uint8 [height, width, 3]
    array: grayscale, RGBA, palette and CMYK converted to RGB, 16- and 32-bit grayscale scaled
    into 0-255.

    Raises what Pillow raises for a file that is not an image, truncated or in a mode it cannot
    convert.
    """
    with Image.open(fp) as im:
        if im.mode.startswith("I"):  # 16/32-bit integer grayscale: scale into 0..255
            arr = np.asarray(im, dtype=np.float64)
            top = 255.0 if arr.max() <= 255 else 65535.0 if arr.max() <= 65535 else arr.max()
            im = Image.fromarray((arr * (255.0 / top)).clip(0, 255).astype(np.uint8), "L")
        return np.array(im.convert("RGB"), dtype=np.uint8)
