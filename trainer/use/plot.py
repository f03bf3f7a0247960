"""The confusion-matrix picture `kfvision evaluate` writes (Pillow only: no plotting library), and
the text helpers the other pictures share (`load_font`, `short`).

Rows are the true classes, columns the predicted ones. Each cell shows its count; its colour is the
share of the true class it holds (the row-normalised matrix, i.e. per-class recall on the
diagonal), so a small class's mistakes are as visible as a large one's.
"""

import io

from PIL import Image, ImageDraw, ImageFont

BLUE = (8, 48, 107)  # darkest cell colour (a full row in one cell)
MARGIN = 12


def load_font(size: int):
    try:
        return ImageFont.load_default(size=size)  # scalable font: Pillow >= 10.1 with FreeType
    except TypeError:
        return ImageFont.load_default()


def _shade(share: float) -> tuple:
    return tuple(round(255 + (c - 255) * share) for c in BLUE)


def _text_size(draw, text, font) -> tuple[int, int]:
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    return right - left, bottom - top


def short(name: str, limit: int = 18) -> str:
    # keep both ends: class names often share a prefix and differ at the end
    half = (limit - 1) // 2
    return name if len(name) <= limit else name[:half] + "…" + name[-(limit - 1 - half):]


def _label(text: str, font, rotate: bool = False) -> Image.Image:
    """Transparent image of `text` (sideways when rotate), cropped to the text."""
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    left, top, right, bottom = probe.textbbox((0, 0), text, font=font)
    img = Image.new("RGBA", (right - left + 2, bottom - top + 2), (255, 255, 255, 0))
    ImageDraw.Draw(img).text((1 - left, 1 - top), text, fill="black", font=font)
    return img.rotate(90, expand=True) if rotate else img


def confusion_matrix_png(matrix, classes, title: str = "Confusion matrix") -> bytes:
    """PNG bytes of a confusion matrix (list of rows of counts; rows true, columns predicted)."""
    n = len(classes)
    cell = max(14, min(64, 720 // max(n, 1)))
    font, small = load_font(max(9, min(16, cell // 3))), load_font(13)
    rows = [_label(short(c), font) for c in classes]
    cols = [_label(short(c), font, rotate=True) for c in classes]
    head = [_label(title, small), _label("predicted class (columns)", small)]
    side = _label("true class (rows)", small, rotate=True)
    left = MARGIN + side.width + 8 + max(r.width for r in rows) + 6
    top = MARGIN + head[0].height + 8 + head[1].height + 6 + max(c.height for c in cols) + 6
    width = max(left + n * cell, MARGIN + head[0].width) + MARGIN
    img = Image.new("RGB", (width, top + n * cell + MARGIN), "white")
    draw = ImageDraw.Draw(img)
    img.paste(head[0], (MARGIN, MARGIN), head[0])
    img.paste(head[1], (left, MARGIN + head[0].height + 8), head[1])
    img.paste(side, (MARGIN, top + max(0, (n * cell - side.height) // 2)), side)
    for i, row in enumerate(matrix):
        total = sum(row) or 1
        for j, count in enumerate(row):
            share = count / total
            box = (left + j * cell, top + i * cell, left + (j + 1) * cell, top + (i + 1) * cell)
            draw.rectangle(box, fill=_shade(share), outline=(220, 220, 220))
            tw, th = _text_size(draw, str(count), font)
            if tw <= cell - 2 and th <= cell - 2:  # skip numbers that do not fit
                draw.text((box[0] + cell / 2, box[1] + cell / 2), str(count), anchor="mm",
                          fill="white" if share > 0.5 else "black", font=font)
        r = rows[i]
        img.paste(r, (left - 6 - r.width, top + i * cell + (cell - r.height) // 2), r)
    for j, c in enumerate(cols):
        img.paste(c, (left + j * cell + (cell - c.width) // 2, top - 6 - c.height), c)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()
