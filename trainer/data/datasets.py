"""Datasets and data loaders over an ImageDirectory.

Small datasets are decoded once into memory (`cache`); augmentation then runs on tiny uint8
tensors instead of re-opening and re-decoding files every epoch, and evaluation crops are computed
once. That is most of why `kfvision train` beats an ImageFolder loop on small images.
"""

import functools
import math
from concurrent.futures import ThreadPoolExecutor

import torch
from kfvision.trainer.data.arrival import begin_epoch, wait_for
from kfvision.trainer.data.decode import JPEG_SUFFIXES, decode_file, jpeg_frame
from kfvision.trainer.data.draws import EpochSampler, split_key
from kfvision.trainer.data.imagedir import ImageDirectory
from kfvision.trainer.data.pack import INDEX, open_pack
from kfvision.trainer.data.transforms import EvalResize, TrainCrop, kept_size, scale_box
from kfvision.trainer.progressbar import progress_bar
from torch.utils.data import DataLoader, Dataset
from torchvision.io import read_file
from torchvision.transforms.v2 import functional as F


def cache_bytes(imdir: ImageDirectory, transform, dct_scaling: bool) -> int:
    """RGB bytes that caching `imdir`'s images for `transform` takes (to decide whether to cache).

    With `dct_scaling` and a `TrainCrop`, every image is kept at `kept_size` (JPEGs decoded at
    that scale, others resized to it); at full size otherwise, and whenever a pack is there (the
    cache then copies its full-size pixels).
    """
    if not (dct_scaling and isinstance(transform, TrainCrop)) or (imdir.root / INDEX).exists():
        return imdir.decoded_bytes()
    return sum(math.prod(kept_size(transform, e.height, e.width)) * 3 for e in imdir.images)


class ImageDataset(Dataset):
    """(uint8 CHW image, label) pairs of an ImageDirectory; label is -1 when unlabelled.

    Indexed by a `Sample` (trainer/data/draws.py: what the training sampler yields), a TrainCrop
    draws image i's crop and flip from that sample's own stream, whichever way the image was
    loaded; by a plain index, from torch's global generator.

    Args:
        imdir: the image directory.
        transform: applied to each uint8 CHW tensor.
        cache: decode every image once up front and keep it in memory.
        precompute: also apply the (deterministic) transform once up front; for evaluation.
        pack: read the directory's pack (raw pixels, `kfvision pack`) when it has an up-to-date
            one, instead of decoding the image files.
        dct_scaling: decode each JPEG knowing what the transform makes of it, at reduced size
            where that still only shrinks it: a `TrainCrop`'s random crop (`load_rgb_crop`) when
            decoded every epoch; with `cache`, at the scale every crop the preset can draw
            allows (`TrainCrop.decode_factor`); an `EvalResize`'s resize, also when
            precomputed. Never for a pack, which holds the full-size pixels.
        threads: decode for `cache` and `precompute` on this many threads (the decoders release
            the GIL); the images are the same, in the same order, whatever the number.
        progress: a progress bar of that decoding (None: only on a terminal).
    """

    def __init__(self, imdir: ImageDirectory, transform, *, cache: bool = False,
                 precompute: bool = False, pack: bool = True, dct_scaling: bool = False,
                 threads: int = 1, progress: bool | None = False):
        self.paths = [imdir.file(e) for e in imdir.images]
        # a referenced directory's files can change under it: each read is checked (check_bytes)
        self.imdir = imdir if imdir.referenced else None
        self.labels = [(-1 if e.label is None else e.label) for e in imdir.images]
        self.sizes = [(e.height, e.width) for e in imdir.images]  # what crops are drawn on
        self.transform = transform
        self.pack = open_pack(imdir) if pack else None
        self.dct_scaling = (dct_scaling and self.pack is None
                            and isinstance(transform, (TrainCrop, EvalResize)))
        self.images = None
        if cache or precompute:
            decode = functools.partial(self._decode, transform=transform if precompute else None)
            self.images = _map_in_threads(decode, len(self.paths), threads,
                                          "decoding" if precompute else "caching", progress)
            if precompute:
                self.transform = None

    def _load(self, i, crop=None, data=None, reduce: int = 1) -> torch.Tensor:
        """Image i; with `crop` = (JPEG bytes, box, size), its crop (`load_rgb_crop`); `data`:
        its file's bytes, already read; `reduce`: see `load_rgb`."""
        if self.pack is not None:
            return self.pack[i]  # a view of the memory-mapped pixels
        if data is None and self.imdir is not None:
            data = self.read(i)
        if crop is not None:
            return decode_file(self.paths[i], crop[0], crop=crop[1:])
        return decode_file(self.paths[i], data, reduce)

    def _decode(self, i, transform=None):
        if self.dct_scaling:  # cached training images, or precomputed evaluation images
            if transform is None:
                return self._decode_for(i, self.transform, apply=False)
            return self._decode_for(i, transform)
        img = self._load(i)
        img = transform(img) if transform is not None else img
        return img.clone() if self.pack is not None else img  # kept: own memory, not the file

    def __len__(self):
        return len(self.paths)

    def read(self, i) -> torch.Tensor:
        """The bytes of image i's file (uint8 tensor); in a referenced directory checked against
        the manifest (ChangedDatasetError naming the file when it changed or is gone)."""
        if self.imdir is None:
            return read_file(str(self.paths[i]))
        e = self.imdir.images[i]
        if self.imdir.arrival is not None:  # fetched while training reads: wait for it
            wait_for(self.paths[i], self.imdir.arrival, str(self.paths[i]))
        try:
            data = read_file(str(self.paths[i]))
        except RuntimeError as err:
            raise self.imdir.changed(e, f"it cannot be read ({err})") from err
        self.imdir.check_bytes(e, data.numpy())
        return data

    def begin_epoch(self, epoch: int, rank: int) -> None:
        """Say which epoch `rank` reads now, where the files arrive as they are read."""
        if self.imdir is not None and self.imdir.arrival is not None:
            begin_epoch(self.imdir.arrival, rank, epoch)

    def __getitem__(self, item):
        i, stream = split_key(item)
        if self.images is None and self.dct_scaling:
            return self._decode_for(i, self.transform, stream=stream), self.labels[i]
        img = self.images[i] if self.images is not None else self._load(i)
        if isinstance(self.transform, TrainCrop):
            img = self._crop(i, img, stream)
        elif self.transform is not None:
            img = self.transform(img)
        return img, self.labels[i]

    def _crop(self, i, img: torch.Tensor, stream) -> torch.Tensor:
        """The TrainCrop of image i: drawn on its full size, whatever size it is kept at (a
        cached JPEG may be kept at reduced size: the same crop box, scaled to it)."""
        kept = tuple(img.shape[-2:])
        full = self.sizes[i] if self.dct_scaling and self.images is not None else kept
        box, flip = self.transform.draw(*full, stream)
        return self.transform.apply(img, scale_box(box, full, kept), flip)

    def _decode_for(self, i, transform, apply: bool = True, stream=None) -> torch.Tensor:
        """`transform` of image i (or, not `apply`, the image to keep for it), the JPEG decoded
        knowing the output from its header's size: a TrainCrop's crop is drawn first; otherwise
        the decode is scaled down as far as `transform.decode_factor` allows. An image kept is
        always at that scale (`kept_size`), whatever its format: `cache_bytes` counts on it.
        `stream`: the stream a TrainCrop draws from (see `split_key`)."""
        path = self.paths[i]
        frame = None
        if str(path).lower().endswith(JPEG_SUFFIXES):
            try:
                data = self.read(i)
                frame = jpeg_frame(data)
            except RuntimeError:
                pass  # unreadable: _load below says so
        if frame is None or 0 in frame[1:3]:  # not a JPEG after all, or no height in the header
            img = self._load(i)
            full = tuple(img.shape[-2:])
        elif apply and isinstance(transform, TrainCrop):
            box, flip = transform.draw(frame[1], frame[2], stream)
            img = self._load(i, (data, box, transform.size))
            return img.flip(-1) if flip else img
        else:
            full = frame[1:3]
            img = self._load(i, data=data, reduce=transform.decode_factor(*full))
        if apply and isinstance(transform, TrainCrop):
            return transform(img, stream)
        if apply:
            return transform(img)
        size = kept_size(transform, *full)
        return img if img.shape[-2:] == size else F.resize(img, list(size), antialias=True)


class EvalShard(Dataset):
    """Every world_size-th item from rank on: each image evaluated exactly once across ranks
    (DistributedSampler would pad with repeats and skew the metrics)."""

    def __init__(self, base: Dataset, rank: int, world_size: int):
        self.base, self.indices = base, range(rank, len(base), world_size)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        return self.base[self.indices[i]]


def _map_in_threads(fn, n: int, threads: int, desc: str, progress) -> list:
    """[fn(0), ..., fn(n - 1)], computed on up to `threads` threads, under a progress bar.

    Threads, not processes: libjpeg-turbo (torchvision) and Pillow release the GIL while they
    decode, so the images need no copying between processes (what two threads gain on two cores:
    docs/benchmarks.md#why-it-is-faster, "Caching")."""
    if threads <= 1 or n < 2:
        return list(progress_bar(map(fn, range(n)), desc, "img", progress, total=n))
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)  # the threads are the parallelism: no OpenMP team for each resize
    pool = ThreadPoolExecutor(min(threads, n), thread_name_prefix="decode")
    try:
        return list(progress_bar(pool.map(fn, range(n)), desc, "img", progress, total=n))
    finally:  # a file that fails (or Ctrl-C) stops the decoding not yet started
        pool.shutdown(cancel_futures=True)
        torch.set_num_threads(intra_op)


def make_loader(dataset: Dataset, *, batch_size: int, workers: int, shuffle: bool, seed: int,
                rank: int = 0, world_size: int = 1, pin_memory: bool = False,
                drop_last: bool = False, collate_fn=None):
    """A DataLoader; with shuffle, over an EpochSampler (trainer/data/draws.py: the order and the
    augmentation keyed by the seed, the epoch and the image, for any world size), returned too so
    that the caller can `set_epoch`; without, in order (sampler None). `collate_fn`: None for the
    default (stacked tensors)."""
    sampler = EpochSampler(len(dataset), seed, rank, world_size, drop_last) if shuffle else None
    # the loader's own generator only seeds its workers' global generators, which nothing of
    # ours draws from; fixed, so that the loader never draws from torch's global one
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
        pin_memory=pin_memory, drop_last=drop_last, generator=generator, collate_fn=collate_fn,
        persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
    )
    return loader, sampler
