"""samples.jpg: a few images of each class of an image directory, in one picture.

The pipeline's image directories hold a manifest and not their images
(kfvision.trainer.data.imagedir, referenced directories), so the KFP UI would show nothing of what a
run trained on; this sheet (one row per class: its name, its count and its first images in manifest
order) is what it shows instead. Pillow only; each image read is checked against the manifest like
any other read.
"""

from pathlib import Path

from PIL import Image, ImageDraw

from kfvision.trainer.data.imagedir import ImageDirectory, read_image_directory
from kfvision.trainer.use.plot import load_font, short

SAMPLES = "samples.jpg"
THUMB = 64  # pixels, the side of each thumbnail
PER_ROW = 8
MAX_ROWS = 20  # classes shown; the rest are counted in the last line


def _thumbnail(imdir: ImageDirectory, e) -> Image.Image:
    import io

    data = imdir.file(e).read_bytes()
    imdir.check_bytes(e, data)
    with Image.open(io.BytesIO(data)) as im:
        im.draft("RGB", (THUMB, THUMB))  # JPEG: decode at reduced size
        im = im.convert("RGB")
        im.thumbnail((THUMB, THUMB))
        return im


def samples_picture(imdir: ImageDirectory) -> Image.Image:
    """The sheet of `imdir` (unlabelled: one row of its first images)."""
    groups = {}
    for e in imdir.images:
        name = imdir.classes[e.label] if e.label is not None else "(unlabelled)"
        groups.setdefault(name, []).append(e)
    shown = list(groups.items())[:MAX_ROWS]
    font = load_font(13)
    label_w = 170
    rows = len(shown) + (len(groups) > MAX_ROWS)
    sheet = Image.new("RGB", (label_w + PER_ROW * (THUMB + 4) + 4, rows * (THUMB + 6) + 6),
                      "white")
    draw = ImageDraw.Draw(sheet)
    for r, (name, entries) in enumerate(shown):
        y = 6 + r * (THUMB + 6)
        draw.text((6, y + THUMB // 2 - 14), short(name, 20), fill="black", font=font)
        draw.text((6, y + THUMB // 2 + 2), f"{len(entries)} images", fill="gray",
                  font=font)
        for c, e in enumerate(entries[:PER_ROW]):
            im = _thumbnail(imdir, e)
            x = label_w + c * (THUMB + 4)
            sheet.paste(im, (x + (THUMB - im.width) // 2, y + (THUMB - im.height) // 2))
    if len(groups) > MAX_ROWS:
        draw.text((6, 6 + len(shown) * (THUMB + 6) + THUMB // 2 - 7),
                  f"... and {len(groups) - MAX_ROWS} more classes", fill="black", font=font)
    return sheet


def write_samples(root) -> ImageDirectory:
    """Write `root`/samples.jpg for the image directory at `root` (not where one of its own
    images has that name); returns the directory."""
    imdir = read_image_directory(root, verify="none")
    if imdir.referenced or not any(e.path == SAMPLES for e in imdir.images):
        samples_picture(imdir).save(Path(root) / SAMPLES, quality=85)
    return imdir
