"""The batched crop, resize and flip of `--gpu-decode` (trainer/data/batchcrop.py) on CPU tensors:
the same calls the GPU runs, with the CPU's roi_align standing in for CUDA's."""

import statistics

import numpy as np
import pytest
import torch
from kfvision.trainer.data.ahead import ahead
from kfvision.trainer.data.batchcrop import resized_crops
from kfvision.trainer.data.datasets import ImageDataset, make_loader
from kfvision.trainer.data.devicedata import EncodedImages, make_device_loader
from kfvision.trainer.data.draws import Sample
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.data.transforms import CROP_PRESETS, Normalizer, train_transform
from kfvision.trainer.presets import IMAGENET_MEAN, IMAGENET_STD
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms.v2 import functional as F

# ImageNet-like sizes, landscape and portrait, and a small square one
SHAPES = [(375, 500), (500, 375), (333, 500), (480, 640), (64, 64)]
SMALL = [(h // 4, w // 4) for h, w in SHAPES]  # where the size does not matter


def _photo(shape, seed: int) -> torch.Tensor:
    """A uint8 CHW image of smooth colour regions with pixel noise, like a photo."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, shape[0] // 16 + 2, shape[1] // 16 + 2, generator=g) * 255
    smooth = F.resize(coarse, list(shape), antialias=True)[0]
    noise = torch.randint(-12, 13, smooth.shape, generator=g)
    return (smooth.round() + noise).clamp(0, 255).to(torch.uint8)


def _stats(boxes, shapes) -> dict:
    area = [h * w / (s[0] * s[1]) for (_, _, h, w), s in zip(boxes, shapes)]
    aspect = [w / h for _, _, h, w in boxes]
    return {"area mean": statistics.mean(area), "area std": statistics.stdev(area),
            "aspect mean": statistics.mean(aspect), "aspect std": statistics.stdev(aspect)}


def test_crop_area_and_aspect_ratio_are_distributed_as_torchvisions():
    """10,000 crops, each from its own keyed stream, the scale and ratio the trainer's default
    preset uses (torchvision's defaults): each mean and standard deviation of the area fraction
    and of the aspect ratio within 2% of RandomResizedCrop's."""
    scale, ratio, _ = CROP_PRESETS["standard"]
    shapes = [SHAPES[i % len(SHAPES)] for i in range(10_000)]
    crop = train_transform("standard", 224)
    ours = [crop.draw(*s, Sample(i, 0, 1).stream())[0] for i, s in enumerate(shapes)]
    torch.manual_seed(0)
    theirs = [RandomResizedCrop.get_params(torch.empty(3, *s), list(scale), list(ratio))
              for s in shapes]
    for boxes in (ours, theirs):
        assert all(min(t, left) >= 0 and t + h <= s[0] and left + w <= s[1]
                   for (t, left, h, w), s in zip(boxes, shapes))
    a, b = _stats(ours, shapes), _stats(theirs, shapes)
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=0.02), (k, a, b)
    assert [crop.draw(*s, Sample(i, 0, 1).stream())[0] for i, s in enumerate(shapes[:5])] \
        == ours[:5]
    flips = [crop.draw(*s, Sample(i, 0, 1).stream())[1] for i, s in enumerate(shapes)]
    assert abs(sum(flips) / len(flips) - 0.5) < 0.02


def test_the_batched_resize_is_torchvisions_resized_crop_within_resampling():
    """Crops of every kind (the whole image, a large one shrunk 2x, a small one enlarged, one at
    the far corner): a level apart on average, as box and triangle antialiasing differ."""
    images = [_photo(s, i) for i, s in enumerate(SHAPES)]
    boxes = [(0, 0, 375, 500), (100, 20, 380, 330), (200, 300, 40, 36), (240, 320, 240, 320),
             (10, 5, 30, 50)]
    out = resized_crops(images, boxes, 224)
    assert out.shape == (5, 3, 224, 224) and out.dtype == torch.uint8
    for img, box, mine in zip(images, boxes, out):
        ref = F.resized_crop(img, *box, [224, 224], antialias=True)
        diff = (mine.int() - ref.int()).abs().float()
        assert diff.mean() < 1.0 and diff.max() <= 16, (box, diff.mean(), diff.max())


def test_a_batch_split_into_canvases_gives_what_one_canvas_gives():
    images = [_photo(s, i) for i, s in enumerate(SMALL * 2)]
    crop = train_transform("standard", 32)
    boxes = [crop.draw(*i.shape[-2:], Sample(k, 1, 1).stream())[0] for k, i in enumerate(images)]
    flips = [i % 3 == 0 for i in range(len(images))]
    one = resized_crops(images, boxes, 32, flips)
    split = resized_crops(images, boxes, 32, flips, canvas_bytes=1)  # one image per canvas
    assert torch.equal(one, split)


def test_flips_flip_exactly_the_images_drawn():
    images = [_photo(s, i) for i, s in enumerate(SMALL)]
    boxes = [(0, 0, *img.shape[-2:]) for img in images]
    some = [True, False, True, True, False]
    plain, flipped = resized_crops(images, boxes, 48), resized_crops(images, boxes, 48, some)
    for p, f, flip in zip(plain, flipped, some):
        assert torch.equal(f, p.flip(-1) if flip else p)


def test_the_normalisation_of_a_batched_batch_is_the_textbook_one(jpeg_dirs):
    (batch, _), = list(_device(read_image_directory(jpeg_dirs["train"]), "standard", 64)[0])
    ours = Normalizer(IMAGENET_MEAN, IMAGENET_STD)(batch, torch.channels_last)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float64).view(1, 3, 1, 1)
    textbook = (batch.double() / 255 - mean) / std
    assert ours.dtype == torch.float32 and ours.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(ours.double(), textbook, rtol=0, atol=1e-6)


def _device(imdir, augment, batch_size, shuffle=False, **options):
    """(the device path's loader on the CPU, its sampler or None)."""
    return make_device_loader(EncodedImages(imdir), augment=augment, image_size=32, device="cpu",
                              batch_size=batch_size, workers=0, shuffle=shuffle, seed=1,
                              **options)


@pytest.mark.parametrize("rank", [0, 1])
def test_labels_and_order_per_rank_are_the_cpu_paths(jpeg_dirs, rank):
    """The same DataLoader, sampler and seed as the CPU path: each rank sees the same images in
    the same order, with the same crops and flips, epoch after epoch (the pixels differ as
    box and triangle antialiasing do)."""
    imdir = read_image_directory(jpeg_dirs["train"])
    shard = {"rank": rank, "world_size": 2, "shuffle": True}
    device, device_sampler = _device(imdir, "standard", 5, **shard)
    cpu, cpu_sampler = make_loader(ImageDataset(imdir, train_transform("standard", 32)),
                                   batch_size=5, workers=0, seed=1, **shard)
    for epoch in (1, 2):
        device_sampler.set_epoch(epoch)
        cpu_sampler.set_epoch(epoch)
        ours, theirs = list(device), list(cpu)
        assert len(ours) == len(theirs) == 4  # 32 images, 16 a rank, batches of 5
        for (a, a_labels), (b, b_labels) in zip(ours, theirs):
            assert torch.equal(a_labels, b_labels)
            assert (a.int() - b.int()).abs().float().mean() < 1.5


def test_batches_made_ahead_on_a_thread_are_the_same_batches(jpeg_dirs):
    imdir = read_image_directory(jpeg_dirs["train"])
    inline, threaded = (_device(imdir, "standard", 7, shuffle=True, prefetch=p)[0]
                        for p in (False, True))
    for _ in range(2):  # two epochs: the augmentation changes, identically in both
        pairs = list(zip(inline, threaded, strict=True))
        assert all(torch.equal(a, b) and torch.equal(la, lb) for (a, la), (b, lb) in pairs)


def test_an_error_while_making_a_batch_ahead_is_raised_where_that_batch_would_come():
    def batches():
        yield torch.zeros(1), torch.zeros(1)
        raise OSError("disk gone")

    got = ahead(batches(), torch.device("cpu"))
    next(got)
    with pytest.raises(OSError, match="disk gone"):
        next(got)


def test_a_consumer_that_stops_early_stops_the_thread():
    made = []

    def batches():
        for i in range(1000):
            made.append(i)
            yield torch.zeros(1), torch.tensor([i])

    got = ahead(batches(), torch.device("cpu"), depth=2)
    assert next(got)[1].item() == 0
    got.close()  # what a `break` out of the epoch, or an error in the step, does
    assert len(made) <= 5


@pytest.fixture(scope="module")
def jpeg_dirs(tmp_path_factory) -> dict:
    """32 JPEGs of two classes, 40-71 px wide (train), and 8 for validation."""
    from kfvision.trainer.data.convert import convert
    from PIL import Image

    root, rng = tmp_path_factory.mktemp("batchcrop"), np.random.default_rng(0)
    for part, n in (("train", 16), ("val", 4)):
        for label, name in enumerate(("red", "blue")):
            folder = root / "raw" / part / name
            folder.mkdir(parents=True)
            for i in range(n):
                base = np.array([[200, 40, 40], [40, 40, 200]][label], dtype=np.int16)
                pixels = base + rng.integers(-40, 40, (40 + i % 7, 40 + 2 * i, 3))
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"{i}.jpg")
        convert(root / "raw" / part, root / part, progress=False)
    return {"train": root / "train", "val": root / "val"}
