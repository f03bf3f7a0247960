"""What a node's fetcher (pipelines/clients/nodefetch.py) fetches, and in which order: the image
directories of the job as the node sees them (`Channel`: the manifest's paths and sizes, the
listing's ETags), the job's world and this node's ranks (`Plan`), and the orders the ranks'
samplers will read in (`rank_order`, the trainer's own draws; `node_order`, the ranks read in
step; `eval_share`, each rank's validation images), and the room it needs on the node's scratch
disk (`check_room`, `ScratchFullError`). Pure functions of the plan, but for `Channel.list`, the
listing that checks every image of the manifest is in the store.
"""

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from kfvision.pipelines.clients import s3
from kfvision.trainer.errors import ChangedDatasetError, OutputError


@dataclass
class Channel:
    """One image directory of the job, as this node fetches it."""

    name: str  # train, val
    uri: str  # s3://bucket/prefix/ (ends with '/')
    paths: list  # each image's path relative to the prefix, in manifest order
    sizes: list  # each image's bytes, in manifest order
    folder: Path  # where the images go (the local manifest's images_root)
    objects: dict = field(default_factory=dict)  # path -> s3.Obj, from the listing

    def __post_init__(self):
        self.index = {p: i for i, p in enumerate(self.paths)}

    def list(self, max_connections: int) -> None:
        """The listing of the prefix: every image of the manifest must be there.

        Raises:
            ChangedDatasetError: an image of the manifest is not in the store.
        """
        bucket, prefix = s3.split_uri(self.uri)
        wanted = set(self.paths)
        for obj in s3.list_objects(self.uri, max_connections):
            rel = obj.key[len(prefix):]
            if rel in wanted:
                self.objects[rel] = obj
        missing = [p for p in self.paths if p not in self.objects]
        if missing:
            raise ChangedDatasetError(
                f"{self.uri}: {len(missing)} image(s) of its manifest are not in the store "
                f"(first: {missing[0]}). Push the image directory again (`kfvision push DIR "
                f"{self.uri}`).")


@dataclass(frozen=True)
class Plan:
    """What the node's ranks read: the job's world, this node's ranks, the sampler's seed."""

    world_size: int
    ranks: tuple  # the global ranks on this node
    seed: int
    epochs: int


def rank_order(n: int, world_size: int, rank: int, seed: int, epoch: int) -> list:
    """The indices `rank` trains on in `epoch`, as the trainer's sampler deals them
    (kfvision.trainer.data.draws.epoch_order, for any world size)."""
    from kfvision.trainer.data.draws import epoch_order

    return epoch_order(n, seed, epoch, rank, world_size)


def node_order(orders: list) -> list:
    """The ranks' orders interleaved position by position (the ranks read in step)."""
    out = []
    for i in range(max(map(len, orders), default=0)):
        out.extend(o[i] for o in orders if i < len(o))
    return out


def eval_share(n: int, world_size: int, ranks) -> list:
    """The validation indices this node's ranks read (kfvision.trainer.data.datasets.EvalShard)."""
    return node_order([list(range(r, n, world_size)) for r in ranks])


class ScratchFullError(OutputError):
    """The node's scratch disk cannot hold what the node fetches: the message says how much room
    it needs and which option gives it (`--scratch-size`)."""


def scratch_full(scratch: Path, need: int, e: OutputError) -> ScratchFullError:
    """The disk `scratch` filled up while fetching (`e`); the node needs `need` bytes of images."""
    return ScratchFullError(
        f"the node's scratch disk ({scratch}) is full: by the end of the run each node holds up "
        f"to the whole dataset, {_gib(need)} ({need:,} bytes) of images, plus the model and its "
        f"checkpoints. Give the job a larger scratch disk (`kfvision job render --scratch-size`, "
        f"e.g. {_gib(need * 1.2 + (1 << 30))}). ({e})")


def check_room(folder: Path, need: int) -> None:
    """Fail before fetching when the scratch disk cannot hold `need` bytes.

    Raises:
        ScratchFullError: the free space is smaller.
    """
    folder.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise ScratchFullError(
            f"the node's scratch disk ({folder}) has {_gib(free)} free, but by the end of the run "
            f"this node holds {_gib(need)} ({need:,} bytes): the whole dataset, the model and "
            "its checkpoints. Give the job a larger scratch disk (`kfvision job render "
            f"--scratch-size`, e.g. {_gib(need * 1.2 + (1 << 30))}).")


def _gib(n: float) -> str:
    return f"{math.ceil(n / (1 << 30) * 10) / 10:g}Gi"
