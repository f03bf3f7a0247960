"""The device-decode input path (--gpu-decode), exercised on the CPU: decode_jpeg(list,
device="cpu") stands in for nvJPEG; everything else is the code the GPU runs."""

import io
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers.paths import REPO
from helpers.runs import DIGITS_RUN, train_argv
from PIL import Image

from kfvision.trainer.config import TrainConfig, config_from_args, get_args_parser
from kfvision.trainer.cpus import usable_cpus
from kfvision.trainer.data.convert import convert
from kfvision.trainer.data.datasets import ImageDataset
from kfvision.trainer.data.devicedata import (
    DeviceDecodeLoader,
    EncodedImages,
    device_decodable,
    make_device_loader,
)
from kfvision.trainer.data.draws import Sample
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.data.transforms import train_transform
from kfvision.trainer.distributed import DistContext
from kfvision.trainer.errors import InvalidParameterError
from kfvision.trainer.fastpath import resolve_fast_path
from kfvision.trainer.train import main


def _image(rng, label: int, size=(48, 40)) -> Image.Image:
    """A noisy image whose mean colour says its class (learnable, like the digits)."""
    base = np.array([[200, 40, 40], [40, 40, 200]][label], dtype=np.int16)
    noise = rng.integers(-40, 40, (size[1], size[0], 3))
    return Image.fromarray((base + noise).clip(0, 255).astype(np.uint8))


def _save(img: Image.Image, path, fmt="JPEG", **options):
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, fmt, **options)


@pytest.fixture(scope="session")
def jpeg_dirs(tmp_path_factory) -> dict:
    """Two classes of small JPEGs: {"raw", "train", "val"} (16 / 8 per class)."""
    root, rng = tmp_path_factory.mktemp("jpegs"), np.random.default_rng(0)
    for part, n in (("train", 16), ("val", 8)):
        for label, name in enumerate(("red", "blue")):
            for i in range(n):
                _save(_image(rng, label, (48 + i, 40)), root / "raw" / part / name / f"{i}.jpg",
                      quality=90)
    for part in ("train", "val"):
        convert(root / "raw" / part, root / part, progress=False)
    return {"raw": root / "raw", "train": root / "train", "val": root / "val"}


@pytest.fixture(scope="session")
def mixed_dir(tmp_path_factory):
    """An image directory of a colour JPEG, a grey JPEG, a CMYK JPEG and a PNG per class."""
    root, rng = tmp_path_factory.mktemp("mixed"), np.random.default_rng(1)
    for label, name in enumerate(("red", "blue")):
        img = _image(rng, label)
        _save(img, root / "raw" / name / "rgb.jpg")
        _save(img.convert("L"), root / "raw" / name / "grey.jpg")
        _save(img.convert("CMYK"), root / "raw" / name / "cmyk.jpg")
        _save(img, root / "raw" / name / "lossless.png", "PNG")
    convert(root / "raw", root / "data", progress=False)
    return read_image_directory(root / "data")


def _loader(imdir, augment, batch_size=8, shuffle=False, seed=1, size=32, workers=0):
    loader, _ = make_device_loader(EncodedImages(imdir), augment=augment, image_size=size,
                                   device="cpu", batch_size=batch_size, workers=workers,
                                   shuffle=shuffle, seed=seed)
    return loader


def _encoded(img: Image.Image, fmt="JPEG", **options) -> torch.Tensor:
    buf = io.BytesIO()
    img.save(buf, fmt, **options)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


@pytest.mark.parametrize("augment", ["standard", "light", "none"])
def test_batches_are_uint8_nchw_with_the_labels_in_order(jpeg_dirs, augment):
    imdir = read_image_directory(jpeg_dirs["train"])
    batches = list(_loader(imdir, augment, batch_size=12))
    assert [tuple(b.shape) for b, _ in batches] == [(12, 3, 32, 32)] * 2 + [(8, 3, 32, 32)]
    assert all(b.dtype == torch.uint8 for b, _ in batches)
    labels = torch.cat([lab for _, lab in batches]).tolist()
    assert labels == [e.label for e in imdir.images]


def test_without_augmentation_the_pixels_are_the_cpu_paths_within_resampling(mixed_dir):
    """PNG and CMYK fall back to the CPU decoder in the dataset; the rest is decoded in a batch.
    The batched resize averages box-filtered bilinear samples where torchvision's antialiasing
    weighs a triangle: on these noisy images (+-40 levels) they differ by a level on average."""
    ds = EncodedImages(mixed_dir)
    kinds = {ds.paths[i].name: ds[i][0].dim() for i in range(len(ds))}
    assert kinds == {"rgb.jpg": 1, "grey.jpg": 1, "cmyk.jpg": 3, "lossless.png": 3}
    (batch, labels), = list(_loader(mixed_dir, "none", batch_size=len(ds)))
    cpu = ImageDataset(mixed_dir, train_transform("none", 32))
    expected = torch.stack([cpu[i][0] for i in range(len(cpu))])
    diff = (batch.int() - expected.int()).abs()
    assert diff.float().mean() < 1.5 and diff.max() <= 12, (diff.float().mean(), diff.max())
    assert labels.tolist() == cpu.labels


def test_worker_processes_give_the_same_batches(mixed_dir):
    """Workers hand over one tensor of JPEG bytes per batch, plus what they decoded themselves."""
    inline, workers = (list(_loader(mixed_dir, "light", batch_size=3, shuffle=True, workers=w))
                       for w in (0, 2))
    assert len(inline) == len(workers) == 3
    for (a, la), (b, lb) in zip(inline, workers):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_a_jpeg_the_decoder_refuses_is_decoded_from_its_file_on_the_cpu(mixed_dir):
    loader = _loader(mixed_dir, "none")
    ds = loader.dataset
    good = next(i for i, p in enumerate(ds.paths) if p.name == "rgb.jpg")
    refused = next(i for i, p in enumerate(ds.paths) if p.name == "grey.jpg")
    broken = ds[refused][0].clone()
    broken[20:] = 0  # headers intact, entropy-coded data gone: libjpeg gives up
    images = loader.decode([ds[good][0], broken], [good, refused])
    assert loader.cpu_fallbacks == 1
    assert torch.equal(images[0], ImageDataset(mixed_dir, None)[good][0])
    assert torch.equal(images[1], ImageDataset(mixed_dir, None)[refused][0])


@pytest.mark.parametrize("make, expected", [
    (lambda img: _encoded(img, quality=90), True),
    (lambda img: _encoded(img.convert("L")), True),
    (lambda img: _encoded(img, progressive=True), True),
    (lambda img: _encoded(img.convert("CMYK")), False),
    (lambda img: _encoded(img, "PNG"), False),
    (lambda img: _encoded(img)[:12], False),  # header cut before the frame
    (lambda img: torch.tensor([0xFF, 0xD8], dtype=torch.uint8), False),
])
def test_only_8_bit_grey_or_colour_jpegs_go_to_the_device(make, expected):
    assert device_decodable(make(_image(np.random.default_rng(2), 0))) is expected


@pytest.mark.parametrize("augment, flips", [("standard", True), ("light", False)])
def test_standard_flips_half_the_images_and_light_none(augment, flips):
    img = torch.arange(3 * 16 * 16, dtype=torch.int64).reshape(3, 16, 16).to(torch.uint8)
    loader = DeviceDecodeLoader(None, augment, 16, "cpu")
    loader.crop.scale, loader.crop.ratio = (1.0, 1.0), (1.0, 1.0)  # whole-image crops: flips only
    out = loader.transform([img] * 64, [Sample(k, 0, 1) for k in range(64)])
    flipped = sum(torch.equal(o, img.flip(-1)) for o in out)
    assert flipped + sum(torch.equal(o, img) for o in out) == 64
    assert (16 <= flipped <= 48) if flips else flipped == 0


def test_augmentation_is_keyed_by_the_seed_and_changes_every_epoch(jpeg_dirs):
    imdir = read_image_directory(jpeg_dirs["train"])
    (a, sampler), (b, _), (c, other) = (make_device_loader(
        EncodedImages(imdir), augment="standard", image_size=32, device="cpu", batch_size=8,
        workers=0, shuffle=True, seed=seed) for seed in (3, 3, 4))
    a1, b1 = list(a), list(b)
    sampler.set_epoch(2)
    a2 = list(a)
    other.set_epoch(2)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a1, b1))
    assert not all(torch.equal(x, y) for (x, _), (y, _) in zip(a1, a2))
    assert not all(torch.equal(x, y) for (x, _), (y, _) in zip(a2, list(c)))


class _Cfg:
    cache, workers, amp, channels_last, compile, image_size = ("auto", -1, "auto", "auto",
                                                               "off", 224)
    gpu_decode, conv_gemm, dct_scaling = "auto", "auto", "on"


@pytest.mark.parametrize("device, setting, cache, decoded, jpeg_share, expected, why", [
    # JPEGs on CUDA, cached or not: decoded and augmented on the GPU
    ("cuda", "auto", "auto", 1 << 50, 1.0, True, "auto: CUDA, JPEGs decoded every epoch"),
    ("cuda", "auto", "off", 1 << 20, 1.0, True, "auto: CUDA, JPEGs decoded every epoch"),
    ("cuda", "auto", "auto", 1 << 50, 0.2, False, "auto: 20% of the training images are JPEGs"),
    # JPEGs that fit the cache too: the cache keeps the validation images only
    ("cuda", "auto", "auto", 1 << 20, 1.0, True,
     "auto: CUDA, JPEGs decoded every epoch on the device (the cache keeps the validation"),
    ("cuda", "off", "auto", 1 << 50, 1.0, False, "--gpu-decode off"),
    ("cpu", "auto", "auto", 1 << 50, 1.0, False, "auto: not CUDA"),  # workers decode already
    ("cpu", "on", "auto", 1 << 20, 0.0, True, "--gpu-decode on"),
])
def test_gpu_decode_auto_is_on_for_cuda_with_jpegs(monkeypatch, device, setting, cache,
                                                            decoded, jpeg_share, expected, why):
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda: True)
    cfg = _Cfg()
    cfg.gpu_decode, cfg.cache = setting, cache
    rt = resolve_fast_path(cfg, DistContext(0, 0, 1, 1, torch.device(device)), decoded, jpeg_share)
    assert rt.gpu_decode is expected
    assert rt.gpu_decode_reason.startswith(why), rt.gpu_decode_reason
    assert rt.conv_gemm is (device == "cpu")  # cuDNN has no per-call weight re-layout to avoid


@pytest.mark.parametrize("variant, cache, gpu_decode", [
    ("default", True, True), ("gpu-decode", True, True), ("gpu-pipeline", False, True),
    ("cpu-decode", False, False), ("cpu-decode-all-cores", False, False)])
def test_each_gpu_benchmark_variant_resolves_to_the_decode_it_is_named_for(monkeypatch, variant,
                                                                          cache, gpu_decode):
    """bench/gpu.sh's kfvision runs on CUDA with the JPEG set (small enough to cache): an uncached
    run whose flags left --gpu-decode at auto would decode with nvJPEG, not on the CPU."""
    import bench.train
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda: True)
    argv = ["--model", "m", "--train", "t", "--val", "v", "--out", "o",
            *bench.train.VARIANTS[variant]]
    cfg = config_from_args(get_args_parser().parse_args(argv))
    rt = resolve_fast_path(cfg, DistContext(0, 0, 1, 1, torch.device("cuda")), 1 << 20, 1.0)
    assert (rt.cache, rt.gpu_decode) == (cache, gpu_decode)
    if variant == "cpu-decode-all-cores":
        assert rt.workers == max(1, usable_cpus() - 1)


def test_gpu_decode_on_with_cache_on_is_refused():
    with pytest.raises(InvalidParameterError, match="--gpu-decode on and --cache on"):
        TrainConfig("m", "t", "v", "o", gpu_decode="on", cache="on").validate()



@pytest.mark.slow
def test_training_through_the_batched_device_path_learns_the_digits_as_the_cpu_path_does(
        tmp_path, resnet18_dir, digits):
    """The digits (PNGs: decoded in the workers, then cropped in batches on the "device") reach
    the bar the CPU path is held to on the same settings: the crops are drawn alike, not
    identically, so the accuracy is compared, not the weights."""
    out = tmp_path / "device"
    assert main(train_argv(resnet18_dir, digits, out, gpu_decode="on", workers=0,
                           **DIGITS_RUN)) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    rt = metrics["fast_path"]
    assert (rt["gpu_decode"], rt["gpu_decode_reason"]) == (True, "--gpu-decode on")
    assert metrics["final"]["val_top1"] > 0.9, metrics["final"]


# The GPU machines have torch, torchvision, pillow and numpy only. PyYAML and tqdm are hidden here
# (None in sys.modules: import fails, find_spec says absent) and must be optional: config.yaml is
# then JSON, convert draws no bar. kfp, scikit-learn and kubernetes must not be imported at all.
_GPU_MACHINE = textwrap.dedent("""
    import json, sys
    sys.modules.update(yaml=None, tqdm=None)
    import bench.train, kfvision.trainer.train
    from kfvision.trainer.data.convert import convert
    raw, out, val, model = sys.argv[1:]
    convert(raw, out + "/train", progress=None)
    rc = kfvision.trainer.train.main(["--model", model, "--train", out + "/train", "--val", val,
                             "--out", out + "/model", "--epochs", "1", "--image-size", "32",
                             "--batch-size", "16", "--workers", "0", "--gpu-decode", "on"])
    config = json.load(open(out + "/model/config.yaml"))
    loaded = sorted({m.split(".")[0] for m in sys.modules} & {"kfp", "sklearn", "kubernetes"})
    print(json.dumps({"rc": rc, "loaded": loaded, "fast_path": config["fast_path"]}))
""")


@pytest.mark.slow
def test_bench_and_trainer_run_without_kfp_sklearn_kubernetes_yaml_tqdm(tmp_path, resnet18_dir,
                                                                        jpeg_dirs):
    run = subprocess.run(
        [sys.executable, "-c", _GPU_MACHINE, str(jpeg_dirs["raw"] / "train"), str(tmp_path),
         str(jpeg_dirs["val"]), str(resnet18_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0 and result["fast_path"]["gpu_decode"] is True
    assert result["loaded"] == [], result
