"""Every random draw of training, keyed by what defines the run.

The order of epoch e is a permutation drawn from a stream keyed by (seed, e); the augmentation of
image i in epoch e (its crop box and flip) from a stream keyed by (seed, e, i). Nothing is drawn
from a generator whose state depends on how the images were loaded: the draws are the same in the
main process or in any DataLoader worker, with the images cached or not, from a folder, a pack or
object storage, read ahead or not, on a machine of any core count. A resumed run needs no generator
state: epoch e's draws follow from e (docs/data.md, "What a run's result depends on").

The sampler hands the dataset a `Sample` (index, seed, epoch), not a bare index, so that a worker
process, which holds its own copy of the dataset made when it started, still knows the epoch.

An image's stream is SHAKE-128 (hashlib) of its key, read as 53-bit uniforms: a counter-based
generator, nothing to seed. Seeding a torch.Generator per image costs about 5x more (a fresh
Mersenne Twister state each time: docs/benchmarks.md, "Keyed draws"); the epoch's order, one
permutation an epoch, uses a keyed torch.Generator.
"""

import hashlib
import math
import struct
from typing import NamedTuple

import torch
from torch.utils.data import Sampler


def stream_key(*parts: int) -> int:
    """A 63-bit seed for torch.Generator from integers (seed, epoch[, index]): a hash, so that
    neighbouring keys give unrelated streams (seed + epoch would make seed 1 epoch 2 the same
    order as seed 2 epoch 1)."""
    digest = hashlib.blake2b(b"".join(p.to_bytes(8, "little", signed=True) for p in parts),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def keyed_generator(*parts: int) -> torch.Generator:
    """A torch.Generator on the CPU seeded by `stream_key(*parts)`."""
    return torch.Generator().manual_seed(stream_key(*parts))


_TO_UNIT = 1.0 / (1 << 53)


class Stream:
    """Uniform numbers in [0, 1) keyed by integers: the bytes of SHAKE-128(key), 8 per number
    (the top 53 bits). The same key gives the same numbers, in any process."""

    def __init__(self, *parts: int):
        self._xof = hashlib.shake_128(struct.pack(f"<{len(parts)}q", *parts))
        self._used = 0

    def uniforms(self, k: int) -> list:
        """The next k numbers of the stream."""
        end = self._used + k
        raw = self._xof.digest(8 * end)[8 * self._used:]  # an XOF: a longer read extends it
        self._used = end
        return [(x >> 11) * _TO_UNIT for x in struct.unpack(f"<{k}Q", raw)]


class GlobalStream:
    """Uniforms from torch's global generator: for a preset used on its own (a dataset indexed
    by a plain index, a transform called by hand), as torchvision's transforms draw."""

    def uniforms(self, k: int) -> list:
        return torch.rand(k, dtype=torch.float64).tolist()


class Sample(NamedTuple):
    """What the training sampler yields: the dataset index, and the key of its draws."""

    index: int
    seed: int
    epoch: int

    def stream(self) -> Stream:
        """The stream of this image's augmentation in this epoch."""
        return Stream(self.seed, self.epoch, self.index)


def split_key(item) -> tuple[int, Stream | None]:
    """(dataset index, its augmentation stream) of a `Sample`; (index, None) of a plain index
    (evaluation, or a dataset indexed by hand: a preset then draws from torch's global RNG)."""
    if isinstance(item, Sample):
        return item.index, item.stream()
    return item, None


def epoch_order(n: int, seed: int, epoch: int, rank: int = 0, world_size: int = 1,
                drop_last: bool = False) -> list:
    """The indices `rank` of `world_size` reads in `epoch`, in order: a permutation of range(n)
    keyed by (seed, epoch), dealt out as DistributedSampler deals (padded with its own start to a
    multiple of world_size, or cut to one with `drop_last`; then every world_size-th from rank)."""
    order = torch.randperm(n, generator=keyed_generator(seed, epoch)).tolist()
    if drop_last and n % world_size:
        total = (n // world_size) * world_size
        order = order[:total]
    else:
        total = math.ceil(n / world_size) * world_size
        pad = total - n
        order += (order * math.ceil(pad / max(n, 1)))[:pad]
    return order[rank:total:world_size]


class EpochSampler(Sampler):
    """The training sampler of every world size: `epoch_order`'s indices as `Sample`s.

    `set_epoch(e)` before each epoch, as with DistributedSampler (the Trainer does)."""

    def __init__(self, n: int, seed: int, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False):
        self.n, self.seed, self.rank, self.world_size = n, seed, rank, world_size
        self.drop_last, self.epoch = drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.drop_last:
            return self.n // self.world_size
        return math.ceil(self.n / self.world_size)

    def __iter__(self):
        for i in epoch_order(self.n, self.seed, self.epoch, self.rank, self.world_size,
                             self.drop_last):
            yield Sample(i, self.seed, self.epoch)
