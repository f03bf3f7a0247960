"""Random resized crops and flips of a whole batch at once, on the batch's device.

`--gpu-decode` hands the training process a batch of images of different sizes, decoded on the
device. Cropping and resizing them one by one (`F.resized_crop`) costs several kernel launches
per image, and the launches, not the arithmetic, bound a step of 256 images. Here the batch goes
through a fixed number of calls however many images it has:

1. the images are copied into one float32 canvas, (N, 3, H + 1, W + 1) for the largest H and W
   (groups of images sorted by size when one canvas would exceed `CANVAS_BYTES`: a few
   12-megapixel photos must not take gigabytes);
2. each image's last column and row are repeated into the canvas's padding (two gather/scatter
   pairs), so that a bilinear sample near an image's far edge reads that edge, as torchvision's
   clamping does, never the zeros of the padding;
3. one `torchvision.ops.roi_align` call resizes every crop box to size x size;
4. one `torch.where` flips the images drawn for it; the result is rounded to a uint8 NCHW batch,
   which `Normalizer` normalises on the device like every other training batch.

Why roi_align, not per-sample affine grids through `grid_sample`: with `sampling_ratio=-1` it
averages ceil(crop side / output side) bilinear samples per output pixel and axis, a box filter as
wide as the scale-down, so a large crop is antialiased; `grid_sample` takes one bilinear sample
per pixel and aliases when it shrinks by 2x or more, as the crops of ImageNet-sized images do.
torchvision's `antialias=True` uses a triangle filter of that width instead of a box: the two
differ by a level or so on photographs (tests/trainer/test_batchcrop.py bounds it). Scaling up (a
small crop) both are plain bilinear. `aligned=True` puts pixel centres at half-integers, as
`F.resize` does.

The crop boxes and flips are drawn on the CPU (trainer/data/devicedata.py: each image's from its
own stream, as the CPU path draws them) and reach the device in one copy from pinned memory: a
tensor copied from pageable memory would make the CPU wait for the steps already queued.
"""

import torch
from torchvision.ops import roi_align

# Most bytes of float32 canvas at once: a batch of 256 ImageNet-sized images (about 500 x 400)
# fits in one, 256 phone photos (4032 x 3024) take about 50 groups.
CANVAS_BYTES = 1 << 30


def _on(device: torch.device, values, dtype) -> torch.Tensor:
    """`values` as a tensor on `device`, copied from pinned memory without waiting on the GPU."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=pinned)


def _groups(shapes: list, canvas_bytes: int) -> list:
    """Lists of indices into `shapes` whose canvases each stay under `canvas_bytes` (one group in
    the given order when the whole batch fits; else sorted by size, so that a group pads little)."""
    def cost(members):
        return (len(members) * 3 * 4 * (max(shapes[k][0] for k in members) + 1)
                * (max(shapes[k][1] for k in members) + 1))

    everyone = list(range(len(shapes)))
    if cost(everyone) <= canvas_bytes:
        return [everyone]
    groups, current = [], []
    for k in sorted(everyone, key=lambda k: (shapes[k][0], shapes[k][1])):
        if current and cost([*current, k]) > canvas_bytes:
            groups.append(current)
            current = []
        current.append(k)  # a single image over the budget still gets its own canvas
    return [*groups, current]


def _resize_group(images: list, boxes: list, size: int) -> torch.Tensor:
    """roi_align of each image's box to size x size: float32 (n, 3, size, size)."""
    device, n = images[0].device, len(images)
    heights = [int(img.shape[-2]) for img in images]
    widths = [int(img.shape[-1]) for img in images]
    height, width = max(heights) + 1, max(widths) + 1
    canvas = torch.zeros((n, 3, height, width), dtype=torch.float32, device=device)
    for i, img in enumerate(images):
        canvas[i, :, :heights[i], :widths[i]].copy_(img)
    sides = _on(device, [heights, widths], torch.int64)
    last_col = (sides[1] - 1).view(n, 1, 1, 1).expand(n, 3, height, 1)
    canvas.scatter_(3, last_col + 1, canvas.gather(3, last_col))
    last_row = (sides[0] - 1).view(n, 1, 1, 1).expand(n, 3, 1, width)
    canvas.scatter_(2, last_row + 1, canvas.gather(2, last_row))
    rois = _on(device, [[i, left, top, left + w, top + h]
                        for i, (top, left, h, w) in enumerate(boxes)], torch.float32)
    return roi_align(canvas, rois, (size, size), spatial_scale=1.0, sampling_ratio=-1,
                     aligned=True)


def resized_crops(images: list, boxes: list, size: int, flips: list | None = None,
                  canvas_bytes: int = CANVAS_BYTES) -> torch.Tensor:
    """Each image's crop `boxes[i]` (top, left, height, width) resized to size x size, flipped
    where `flips[i]`: a uint8 (N, 3, size, size) batch on the images' device.

    Args:
        images: uint8 (3, H, W) tensors, all on one device, of any sizes.
        boxes: one box per image, inside it.
        size: side of the square outputs.
        flips: one bool per image (None: no flips).
        canvas_bytes: the most float32 canvas one roi_align call takes (see `CANVAS_BYTES`).
    """
    device = images[0].device
    shapes = [tuple(int(s) for s in img.shape[-2:]) for img in images]
    groups = _groups(shapes, canvas_bytes)
    parts = [_resize_group([images[k] for k in g], [boxes[k] for k in g], size) for g in groups]
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    if len(groups) > 1:  # back to the batch's order
        order = [k for g in groups for k in g]
        inverse = [0] * len(order)
        for position, k in enumerate(order):
            inverse[k] = position
        out = out.index_select(0, _on(device, inverse, torch.int64))
    if flips is not None and any(flips):
        flip = _on(device, flips, torch.bool).view(-1, 1, 1, 1)
        out = torch.where(flip, out.flip(-1), out)
    return out.round_().clamp_(0, 255).to(torch.uint8)
