"""Each fast-path switch gives the same results as the plain path (within a tolerance)."""

import io
import json
import os
import statistics

import numpy as np
import pytest
import torch
from helpers.machine import fake_cpu
from helpers.runs import DIGITS_RUN, train_argv
from PIL import Image
from PIL.JpegImagePlugin import JpegImageFile
from torchvision.io import read_file
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from kfvision.trainer.data.convert import convert
from kfvision.trainer.data.datasets import ImageDataset, cache_bytes
from kfvision.trainer.data.decode import dct_factor, load_rgb, load_rgb_crop
from kfvision.trainer.data.draws import Sample
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.data.pack import write_pack
from kfvision.trainer.data.transforms import EvalResize, Normalizer, TrainCrop
from kfvision.trainer.distributed import DistContext
from kfvision.trainer.errors import InvalidDatasetError
from kfvision.trainer.fastpath import (
    FAMILY_CHOICES,
    cpu_bf16_kind,
    cpu_features,
    cpu_info,
    describe,
    describe_cpu,
    int8_reduce_range,
    resolve_fast_path,
)
from kfvision.trainer.presets import ARCHITECTURES, AUGMENTATIONS
from kfvision.trainer.train import main

BASE = {"epochs": 2, "image_size": 32, "batch_size": 16, "lr": 0.05, "augment": "light",
        "print_freq": 1000, "workers": 0}


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_the_jpeg_decoder_gives_pillows_pixels(tmp_path, mode):
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (37, 53, 3), dtype=np.uint8)).convert(mode)
    img.save(tmp_path / "x.jpg", quality=90)
    ours = load_rgb(tmp_path / "x.jpg")
    pillow = torch.from_numpy(np.asarray(Image.open(tmp_path / "x.jpg").convert("RGB")).copy())
    assert torch.equal(ours, pillow.permute(2, 0, 1))


def test_a_png_named_jpg_still_loads(tmp_path):
    buf = io.BytesIO()
    Image.new("RGB", (5, 4), (1, 2, 3)).save(buf, "PNG")
    (tmp_path / "x.jpg").write_bytes(buf.getvalue())
    assert load_rgb(tmp_path / "x.jpg")[:, 0, 0].tolist() == [1, 2, 3]


def _photo(path, size=(1600, 1200), mode="RGB", seed=1):
    """A JPEG (quality 90) of smooth colour regions with pixel noise, like a photo."""
    rng = np.random.default_rng(seed)
    field = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize(
        size, Image.Resampling.BICUBIC)
    arr = np.asarray(field, np.float32) + rng.normal(0, 20, (size[1], size[0], 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).convert(mode).save(path, quality=90)
    return path


@pytest.mark.parametrize("augment", AUGMENTATIONS)
def test_the_training_presets_crop_as_torchvision_does_from_each_images_own_stream(augment):
    """The box and flip drawn from a sample's stream, cut and resized by torchvision's v2
    functionals (RandomResizedCrop's and RandomHorizontalFlip's); the same key, the same crop."""
    img = torch.randint(0, 256, (3, 50, 70), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(0))
    crop, flips = TrainCrop(augment, 24), 0
    for i in range(30):
        box, flip = crop.draw(50, 70, Sample(i, 3, 1).stream())
        flips += flip
        expected = F.resized_crop(img, *box, [24, 24], antialias=True)
        expected = F.horizontal_flip(expected) if flip else expected
        assert torch.equal(crop(img, Sample(i, 3, 1).stream()), expected)
        assert crop.draw(50, 70, Sample(i, 3, 1).stream()) == (box, flip)
        if augment == "none":
            assert box == (0, 0, 50, 70)
    assert (5 <= flips <= 25) if augment == "standard" else flips == 0


@pytest.mark.parametrize("box, factor", [
    ((0, 0, 224, 224), 1), ((5, 9, 447, 3000), 1), ((0, 0, 448, 448), 2),
    ((0, 0, 1792, 900), 4), ((7, 3, 3000, 4000), 8)])
def test_jpegs_are_decoded_at_reduced_size_only_when_the_crop_stays_larger(box, factor):
    assert dct_factor(box, 224) == factor


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
@pytest.mark.parametrize("box, factor", [
    ((100, 200, 1000, 1200), 8), ((0, 0, 1200, 1600), 8), ((300, 50, 500, 460), 4),
    ((10, 10, 230, 230), 2)])
def test_a_jpeg_decoded_at_reduced_size_gives_the_crop_of_the_full_decode(
        tmp_path, monkeypatch, mode, box, factor):
    path = _photo(tmp_path / "photo.jpg", mode=mode)
    requested = []
    draft = JpegImageFile.draft
    monkeypatch.setattr(JpegImageFile, "draft",
                        lambda im, m, size: requested.append(size) or draft(im, m, size))
    ours = load_rgb_crop(path, read_file(str(path)), box, 100)
    full = F.resized_crop(load_rgb(path), *box, [100, 100], antialias=True)
    assert requested == [(1600 // factor, 1200 // factor)]  # libjpeg did the scaling
    assert ours.shape == full.shape == (3, 100, 100) and ours.dtype == torch.uint8
    diff = (ours.int() - full.int()).abs().float()
    assert diff.mean() < 3 and diff.max() < 24, (diff.mean(), diff.max())


def _images(tmp_path, size, n=6):
    raw = tmp_path / f"raw{size[0]}"
    for i in range(n):
        _photo(raw / f"c{i % 2}" / f"{i}.jpg", size=size, seed=i)
    (raw / "c0" / "x.png").write_bytes((raw / "c0" / "0.jpg").read_bytes())  # a JPEG named .png
    Image.open(raw / "c1" / "1.jpg").save(raw / "c1" / "y.jpg", "PNG")  # a PNG named .jpg
    convert(raw, tmp_path / f"dir{size[0]}", progress=False)
    return read_image_directory(tmp_path / f"dir{size[0]}")


@pytest.mark.parametrize("size, exact", [((60, 40), True), ((640, 480), False)])
def test_dct_scaling_draws_the_crops_and_flips_of_the_plain_path(tmp_path, size, exact):
    """Decoded every epoch knowing the crop, or cached at the scale every crop allows (here 1/4):
    the same crop boxes and flips as the full-size decode (the box scaled to the kept image), the
    pixels equal where no JPEG is scaled down, close where one is (another crop of the same
    image is 60 levels away on average)."""
    imdir = _images(tmp_path, size)
    plain, streaming, cached = (
        ImageDataset(imdir, TrainCrop("standard", 32), dct_scaling=dct, cache=cache, pack=False)
        for dct, cache in ((False, False), (True, False), (True, True)))
    keys = [Sample(i, 1, epoch) for i in range(len(plain)) for epoch in range(4)]
    diffs = {"streaming": [], "cached": []}
    for key in keys:
        a, label = plain[key]
        for name, other in (("streaming", streaming), ("cached", cached)):
            b, other_label = other[key]
            assert label == other_label and a.shape == b.shape == (3, 32, 32)
            diffs[name].append((a.int() - b.int()).abs().float().mean().item())
    if exact:
        assert max(diffs["streaming"] + diffs["cached"]) == 0
    else:  # resampling at 1/4 scale, and the box rounded to whole pixels of the kept image
        assert statistics.mean(diffs["streaming"]) < 2 and max(diffs["streaming"]) < 3, diffs
        assert statistics.mean(diffs["cached"]) < 4 and max(diffs["cached"]) < 8, diffs


@pytest.mark.parametrize("augment, height, width, factor", [
    ("standard", 3024, 4032, 2), ("standard", 375, 500, 1), ("light", 3024, 4032, 8),
    ("light", 600, 800, 2), ("none", 3024, 4032, 8), ("none", 447, 4000, 1)])
def test_a_cached_image_is_kept_at_the_scale_every_crop_allows(augment, height, width, factor):
    crop = TrainCrop(augment, 224)
    assert crop.decode_factor(height, width) == factor
    # every crop torchvision draws from an image kept at reduced scale still shrinks to 224
    kept = (-(-height // factor), -(-width // factor))  # libjpeg rounds the scaled size up
    torch.manual_seed(0)
    least = min(min(crop.draw(*kept)[0][2:]) for _ in range(3000))
    assert factor == 1 or least >= 224, least


def test_the_cache_keeps_large_images_at_reduced_size(tmp_path):
    imdir = _images(tmp_path, (1600, 1200), n=4)
    ds = ImageDataset(imdir, TrainCrop("light", 64), cache=True, dct_scaling=True, pack=False)
    for path, img in zip(ds.paths, ds.images):  # 1/8: the smallest light crop is 1065 px
        assert img.shape == (3, 150, 200), path  # JPEGs by libjpeg, the others resized
        if path.suffix != ".jpg" or path.stem == "y":  # a JPEG named .png, a PNG named .jpg
            expected = F.resize(load_rgb(path), [150, 200], antialias=True)
            assert torch.equal(img, expected), path
    torch.manual_seed(0)
    assert all(ds[i][0].shape == (3, 64, 64) for i in range(len(ds)))
    full = ImageDataset(imdir, TrainCrop("light", 64), cache=True, pack=False)
    assert all(torch.equal(img, load_rgb(p)) for p, img in zip(full.paths, full.images))


@pytest.mark.parametrize("dct", [False, True])
def test_decoding_up_front_on_threads_keeps_the_same_images_in_the_same_order(tmp_path, dct):
    """The cache and the precomputed evaluation crops, decoded on 3 threads (train.py gives them
    the process's cores): the very tensors one thread makes, JPEGs, a PNG and misnamed files."""
    imdir = _images(tmp_path, (640, 480), n=8)
    intra_op = torch.get_num_threads()
    for kind in ({"cache": True}, {"precompute": True}):
        transform = TrainCrop("light", 64) if "cache" in kind else EvalResize("standard", 48)
        one, three = (ImageDataset(imdir, transform, pack=False, dct_scaling=dct, threads=t,
                                   **kind) for t in (1, 3))
        assert len(three.images) == len(one.images) == len(imdir.images)
        assert all(torch.equal(a, b) for a, b in zip(one.images, three.images)), kind
        assert torch.get_num_threads() == intra_op  # set to 1 while the threads decode, restored


def test_the_decision_to_cache_counts_the_reduced_size_unless_a_pack_is_there(tmp_path):
    imdir = _images(tmp_path, (1600, 1200), n=4)  # 4 JPEGs, a JPEG named .png, a PNG named .jpg
    crop = TrainCrop("light", 64)
    full = 1600 * 1200 * 3
    assert cache_bytes(imdir, crop, False) == imdir.decoded_bytes() == 6 * full
    assert cache_bytes(imdir, crop, True) == 6 * full // 64
    ds = ImageDataset(imdir, crop, cache=True, dct_scaling=True, pack=False)
    assert sum(img.numel() for img in ds.images) == cache_bytes(imdir, crop, True)
    write_pack(imdir.root, progress=False)  # the cache then copies the pack's full-size pixels
    assert cache_bytes(imdir, crop, True) == 6 * full


@pytest.mark.parametrize("augment", AUGMENTATIONS)
def test_the_evaluation_presets_resize_as_torchvision_does(augment):
    img = torch.randint(0, 256, (3, 61, 97), dtype=torch.uint8)
    expected = (v2.Compose([v2.Resize(73, antialias=True), v2.CenterCrop(64)])
                if augment == "standard" else v2.Resize((64, 64), antialias=True))
    assert torch.equal(EvalResize(augment, 64)(img), expected(img))


@pytest.mark.parametrize("augment, height, width, factor", [
    ("standard", 1200, 1600, 8), ("standard", 1168, 5000, 8), ("standard", 1167, 5000, 4),
    ("standard", 300, 400, 2), ("standard", 291, 4000, 1), ("none", 1200, 1600, 8),
    ("none", 511, 2000, 4), ("light", 127, 5000, 1), ("light", 128, 128, 2)])
def test_evaluation_scales_the_decode_only_while_the_resize_still_shrinks(augment, height,
                                                                         width, factor):
    # standard at 128 px: the shorter side is resized to 146; none/light: both sides to 64
    size = 128 if augment == "standard" else 64
    assert EvalResize(augment, size).decode_factor(height, width) == factor


@pytest.mark.parametrize("augment", ["standard", "none"])
@pytest.mark.parametrize("size, exact", [((60, 40), True), ((1600, 1200), False)])
def test_dct_scaling_evaluates_what_the_full_decode_does(tmp_path, augment, size, exact):
    imdir = _images(tmp_path, size)
    plain = ImageDataset(imdir, EvalResize(augment, 48))
    scaled = ImageDataset(imdir, EvalResize(augment, 48), dct_scaling=True)
    precomputed = ImageDataset(imdir, EvalResize(augment, 48), dct_scaling=True, precompute=True)
    for i in range(len(plain)):
        (a, la), (b, lb), (c, lc) = plain[i], scaled[i], precomputed[i]
        assert la == lb == lc and a.shape == b.shape == (3, 48, 48) and torch.equal(b, c)
        diff = (a.int() - b.int()).abs().float()
        assert diff.max() == 0 if exact else diff.mean() < 3, diff.mean()
    big = next(i for i, p in enumerate(plain.paths) if p.name == "0.jpg")
    assert exact or not torch.equal(plain[big][0], scaled[big][0])  # it did decode smaller


def test_dct_scaling_names_a_broken_jpeg(tmp_path):
    imdir = _images(tmp_path, (640, 480), n=2)
    ds = ImageDataset(imdir, TrainCrop("standard", 32), dct_scaling=True)
    jpeg = next(i for i, p in enumerate(ds.paths) if p.suffix == ".jpg" and p.stem == "0")
    ds.paths[jpeg].write_bytes(ds.paths[jpeg].read_bytes()[:2000])  # truncated
    with pytest.raises(InvalidDatasetError, match="can no longer be decoded"):
        for _ in range(20):  # whatever crop is drawn
            ds[jpeg]


def _train(tmp_path, name, model, data, **options):
    out = tmp_path / name
    assert main(train_argv(model, data, out, **{**BASE, **options})) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    return torch.load(out / "weights.pt", weights_only=True), metrics["final"]


@pytest.mark.slow
def test_cache_on_and_off_train_the_identical_model(tmp_path, resnet18_dir, tiny_digits):
    on, _ = _train(tmp_path, "on", resnet18_dir, tiny_digits, cache="on")
    off, _ = _train(tmp_path, "off", resnet18_dir, tiny_digits, cache="off")
    assert all(torch.equal(on[k], off[k]) for k in on)


def test_channels_last_gives_the_same_outputs_and_gradients():
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    results = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        m = model.to(memory_format=fmt)
        m.zero_grad()
        out = m(x.contiguous(memory_format=fmt))
        torch.nn.functional.cross_entropy(out, y).backward()
        results.append((out.detach().clone(), [p.grad.clone() for p in m.parameters()]))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o1, o2, rtol=1e-4, atol=1e-4)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("out_format", [torch.contiguous_format, torch.channels_last])
def test_the_normalizer_is_the_textbook_normalisation(layout, out_format):
    batch = torch.randint(0, 256, (3, 3, 7, 5), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    mean, std = (0.5, 0.25, 0.125), (0.2, 0.3, 0.4)
    out = Normalizer(mean, std)(batch.contiguous(memory_format=layout), out_format)
    textbook = (batch.double() / 255 - torch.tensor(mean, dtype=torch.double).view(1, 3, 1, 1)) \
        / torch.tensor(std, dtype=torch.double).view(1, 3, 1, 1)
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=out_format)
    torch.testing.assert_close(out.double(), textbook, rtol=0, atol=2e-6)


@pytest.mark.slow  # 11 s of CPU when it is the first in its process to take the fused step
def test_the_fused_sgd_step_is_the_textbook_sgd_step():
    import torchvision

    from kfvision.trainer.engine import make_sgd

    torch.manual_seed(0)
    fused_model = torchvision.models.resnet18(num_classes=4)
    plain_model = torchvision.models.resnet18(num_classes=4)
    plain_model.load_state_dict(fused_model.state_dict())
    fused = make_sgd(fused_model, 0.1, 0.9, 1e-4)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4,
                            foreach=False)
    assert fused.defaults["fused"]  # this torch has the fused kernel on CPU: the fast path is on
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 4, (4,))
    for _ in range(3):  # the second and later steps use the momentum buffer
        for model, opt in ((fused_model, fused), (plain_model, plain)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# bf16 where the running CPU (less what ONEDNN_MAX_CPU_ISA hides) does it natively; where oneDNN
# emulates it (AVX2 only: the whole fast path took 96 s against 6 s with the kernels limited to
# AVX2), the fast path as `--amp auto` takes it there, fp32; bf16 emulated: test below
WHOLE_AMP = "bf16" if cpu_bf16_kind(cpu_features().flags) else "auto"


@pytest.mark.slow
def test_the_whole_fast_path_reaches_the_accuracy_of_the_default_path_on_the_digits(
        tmp_path, resnet18_dir, digits, digits_trained):
    """Against the made-once run at the defaults (at 32 px on a CPU: fp32, NCHW; one-pixel
    convolutions as GEMM and the cache in both)."""
    _, fast = _train(tmp_path, "fast", resnet18_dir, digits, amp=WHOLE_AMP, channels_last="on",
                     cache="on", **DIGITS_RUN)
    default = digits_trained["final"]
    # both draw the same augmentations (keyed per sample): what differs is the float order of
    # channels-last and bf16, whose divergence over 3 epochs of one seed (with one-pixel
    # convolutions as GEMM against without) moved top-1 by 0.039 on an AVX2 EPYC (fp32 there);
    # the bar every digits run is held to, and no more than 0.05 below the default path
    assert fast["val_top1"] > 0.9, (default, fast)
    assert fast["val_top1"] >= default["val_top1"] - 0.05, (default, fast)


@pytest.mark.slow
def test_bf16_asked_for_where_it_is_emulated_trains_and_says_so(tmp_path, resnet18_dir,
                                                                 micro_digits):
    """`--amp bf16` with oneDNN limited to AVX2, as on an AVX2-only CPU such as an EPYC Milan
    (PyTorch then runs bf16 convolutions on its own kernels, not oneDNN's): the start-up line
    says bf16 is emulated, and the training is the fp32 one to within bf16's precision."""
    import subprocess
    import sys
    from pathlib import Path

    def train(name, amp):
        argv = train_argv(resnet18_dir, micro_digits, tmp_path / name,
                          **{**BASE, "epochs": 1, "print_freq": 1}, amp=amp, channels_last="on")
        run = subprocess.run([sys.executable, "-m", "kfvision.trainer.train", *argv], text=True,
                             env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"},
                             cwd=Path(__file__).parents[1], capture_output=True)
        assert run.returncode == 0, run.stderr[-3000:]
        losses = [float(line.split("loss ")[1].split()[0]) for line in run.stdout.splitlines()
                  if "epoch 1 [" in line]
        return run.stdout, losses

    out, bf16 = train("bf16", "bf16")
    assert "(--amp bf16; emulated: this CPU has neither AMX nor AVX512_BF16, slower than " \
           "fp32)" in out
    _, fp32 = train("fp32", "off")
    assert len(bf16) == len(fp32) >= 2
    assert bf16[0] == pytest.approx(fp32[0], rel=0.02)  # the same first batch, the same weights


class _Cfg:
    cache, workers, amp, channels_last, compile, image_size = ("auto", -1, "auto", "auto",
                                                               "off", 224)
    gpu_decode, conv_gemm, dct_scaling = "auto", "auto", "on"


AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"})
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"})  # e.g. AMD EPYC (Zen 4)
NEITHER = frozenset({"avx2", "avx512f", "avx512_vnni"})  # e.g. Ice Lake, or no AVX-512 at all


@pytest.mark.parametrize("flags, size, decoded, expect, why", [
    (AMX, 224, 10 << 20, {"cache": True, "workers": 0, "amp": True, "channels_last": True},
     "bf16 autocast (AMX, 224 px)"),
    (AMX, 32, 10 << 20, {"cache": True, "workers": 0, "amp": False, "channels_last": False},
     "fp32 (AMX, but 32 px < 96 px)"),
    (AMX, 80, 10 << 20, {"amp": False, "channels_last": False}, "fp32 (AMX, but 80 px < 96 px)"),
    (AMX, 96, 10 << 20, {"amp": True, "channels_last": True}, "bf16 autocast (AMX, 96 px)"),
    (AVX512_BF16, 224, 10 << 20, {"cache": True, "workers": 0, "amp": True,
                                  "channels_last": True}, "bf16 autocast (AVX512_BF16, 224 px)"),
    (AVX512_BF16, 32, 10 << 20, {"amp": False, "channels_last": False},
     "fp32 (AVX512_BF16, but 32 px < 64 px)"),
    (AVX512_BF16, 48, 10 << 20, {"amp": False}, "fp32 (AVX512_BF16, but 48 px < 64 px)"),
    (AVX512_BF16, 64, 10 << 20, {"amp": True, "channels_last": True},
     "bf16 autocast (AVX512_BF16, 64 px)"),
    (AMX, 64, 10 << 20, {"amp": False}, "fp32 (AMX, but 64 px < 96 px)"),
    (NEITHER, 224, 10 << 20, {"cache": True, "workers": 0, "amp": False, "channels_last": False},
     "fp32 (no native bf16 on this CPU (neither AMX nor AVX512_BF16))"),
    (frozenset(), 224, 10 << 20, {"amp": False, "channels_last": False}, "fp32 (no native"),
    (AMX, 224, 1 << 50, {"cache": False, "workers": 1, "amp": True, "channels_last": True},
     "bf16 autocast (AMX"),
    (AVX512_BF16, 224, 1 << 50, {"cache": False, "workers": 1, "amp": True}, "bf16 autocast"),
])
def test_auto_picks_per_machine_on_cpu(monkeypatch, flags, size, decoded, expect, why):
    """The decisions from the CPU's flags (mocked), whatever this machine is."""
    fake_cpu(monkeypatch, flags)
    monkeypatch.setattr("kfvision.trainer.fastpath.cpus_per_process", lambda ctx: 2)
    cfg = _Cfg()
    cfg.image_size = size
    rt = resolve_fast_path(cfg, DistContext(0, 0, 1, 1, torch.device("cpu")), decoded)
    assert {k: getattr(rt, k) for k in expect} == expect and not rt.compile
    assert rt.conv_gemm  # on CPU; CUDA: see test_devicedata's table
    assert why in describe(rt)
    assert rt.cpu == cpu_features().to_dict() and rt.to_dict()["cpu"]["model"] == "a CPU"


BY_HAND = {"amp": ("bf16", "off"), "channels_last": ("on", "off"), "conv_gemm": ("on", "off")}


def test_family_choices_names_families_and_auto_choices():
    assert set(FAMILY_CHOICES) <= set(ARCHITECTURES) and "resnet" not in FAMILY_CHOICES
    assert all(set(fixed) <= set(BY_HAND) and all(why for _, why in fixed.values())
               for fixed in FAMILY_CHOICES.values())


@pytest.mark.parametrize("family, choice", [(f, c) for f, fixed in FAMILY_CHOICES.items()
                                            for c in fixed])
def test_a_family_gets_what_family_choices_says_and_fast_path_records_it(monkeypatch, family,
                                                                         choice):
    """The family's choice comes from the one table, where resnet (not in it) gets `auto`'s rule
    (on one of two CPUs it differs); asked for by hand, the other value wins."""
    on, why = FAMILY_CHOICES[family][choice]
    ctx = DistContext(0, 0, 1, 1, torch.device("cpu"))
    differs = False
    for flags in (AVX512_BF16, NEITHER):  # auto: bf16 + NHWC at 224 px; fp32 NCHW
        fake_cpu(monkeypatch, flags)
        theirs = resolve_fast_path(_Cfg(), ctx, 10 << 20, family=family)
        resnet = resolve_fast_path(_Cfg(), ctx, 10 << 20, family="resnet")
        assert getattr(theirs, choice) is on and resnet.family_choices == {}
        assert theirs.family_choices[choice] == f"{'on' if on else 'off'}: {why}"
        assert theirs.to_dict()["family"] == family and f"for {family}" in describe(theirs)
        differs |= getattr(resnet, choice) is not on
        cfg = _Cfg()
        setattr(cfg, choice, BY_HAND[choice][on])  # the opposite value, by hand
        assert getattr(resolve_fast_path(cfg, ctx, 10 << 20, family=family), choice) is not on
    assert differs
    # CUDA is not measured per family: untouched (no GPU here: its bf16 answer is given)
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda: True)
    cuda = DistContext(0, 0, 1, 1, torch.device("cuda"))
    assert resolve_fast_path(_Cfg(), cuda, 10 << 20, family=family).family_choices == {}


@pytest.mark.parametrize("flags", [AMX, AVX512_BF16, NEITHER])
@pytest.mark.parametrize("amp, on", [("bf16", True), ("off", False)])
def test_amp_on_or_off_is_what_it_says_on_every_cpu(monkeypatch, flags, amp, on):
    fake_cpu(monkeypatch, flags)
    cfg = _Cfg()
    cfg.amp = amp
    rt = resolve_fast_path(cfg, DistContext(0, 0, 1, 1, torch.device("cpu")), 10 << 20)
    assert rt.amp is on and rt.channels_last is on
    emulated = on and flags == NEITHER  # said, since a user who asked for speed gets less
    assert (f"(--amp {amp}; emulated: this CPU has neither AMX nor AVX512_BF16, slower than "
            f"fp32)" if emulated else f"(--amp {amp})") in describe(rt)


def test_without_onednn_no_cpu_has_native_bf16(monkeypatch):
    monkeypatch.setattr("torch.backends.mkldnn.is_available", lambda: False)
    assert cpu_bf16_kind(AMX) is None and cpu_bf16_kind(AVX512_BF16) is None


def test_the_cpu_is_read_from_proc_cpuinfo(monkeypatch, tmp_path):
    (tmp_path / "cpuinfo").write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu\n")
    model, flags = cpu_info(tmp_path / "cpuinfo")
    assert model == "AMD EPYC 9R14" and flags == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_info(tmp_path / "missing") == ("", frozenset())
    fake_cpu(monkeypatch, flags, model)
    assert describe_cpu().startswith("CPU: AMD EPYC 9R14 (AVX512_BF16), ")
    assert ("flags avx2 avx512_bf16 (bf16 for --amp auto: AVX512_BF16; int8: no VNNI, 7-bit "
            "weights)") in describe_cpu()


MILAN = frozenset({"fpu", "avx", "avx2", "fma"})  # AMD EPYC Milan: no AVX-512, no VNNI
ALDER_LAKE = frozenset({"avx2", "fma", "avx_vnni"})  # AVX-VNNI without AVX-512


@pytest.mark.parametrize("flags, kind, vnni", [
    (AMX, "AMX", True),
    (AVX512_BF16, "AVX512_BF16", True),
    (NEITHER, "AVX-512", True),
    (frozenset({"avx2", "avx512f"}), "AVX-512", False),  # Skylake-SP: AVX-512 without VNNI
    (ALDER_LAKE, "AVX2 only", True),
    (MILAN, "AVX2 only", False),
    (frozenset({"sse4_2"}), "older than AVX2", False),
])
def test_the_cpu_kind_and_the_int8_choice_follow_its_flags(monkeypatch, flags, kind, vnni):
    fake_cpu(monkeypatch, flags)
    cpu = cpu_features()
    assert (cpu.kind, cpu.vnni) == (kind, vnni)
    assert int8_reduce_range() is (not vnni) and int8_reduce_range(cpu) is (not vnni)
    assert cpu.to_dict()["kind"] == kind and f"({kind})" in describe_cpu()


@pytest.mark.parametrize("cap, kind, vnni, bf16", [
    ("AVX2", "AVX2 only", False, None),
    ("avx2", "AVX2 only", False, None),  # oneDNN reads it in any case
    ("AVX2_VNNI", "AVX2 only", True, None),
    ("AVX512_CORE", "AVX-512", False, None),
    ("AVX512_CORE_VNNI", "AVX-512", True, None),
    ("AVX512_CORE_BF16", "AVX512_BF16", True, "AVX512_BF16"),
    ("AVX512_CORE_AMX", "AMX", True, "AMX"),
    ("", "AMX", True, "AMX"),
    ("NOT_AN_ISA", "AMX", True, "AMX"),  # oneDNN ignores what it does not know; so do we
])
def test_an_onednn_isa_cap_makes_the_choices_of_the_older_cpu(monkeypatch, cap, kind, vnni,
                                                               bf16):
    """ONEDNN_MAX_CPU_ISA=AVX2 on an AMX Xeon runs the kernels of an AVX2-only CPU: the choices
    (bf16, int8 weights) must be that CPU's."""
    fake_cpu(monkeypatch, AMX | {"avx_vnni", "avx512_vnni", "fma"})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    cpu = cpu_features()
    assert (cpu.kind, cpu.vnni, cpu_bf16_kind()) == (kind, vnni, bf16)
    assert int8_reduce_range() is (not vnni)
    assert (cpu.isa_cap is None) == (cap.upper() in ("", "NOT_AN_ISA"))
