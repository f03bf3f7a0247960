"""The keyed draws of training (trainer/data/draws.py): the order of an epoch and each image's
augmentation follow from the seed, the epoch and the image, however the images are loaded."""

import shutil

import pytest
import torch
from kfvision.trainer.data.datasets import ImageDataset, make_loader
from kfvision.trainer.data.draws import EpochSampler, Sample, Stream, epoch_order
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.data.pack import write_pack
from kfvision.trainer.data.transforms import train_transform


def test_a_stream_is_its_key_and_reads_on_where_it_stopped():
    one = Stream(5, 2, 17)
    first, more = one.uniforms(5), one.uniforms(4)
    assert first + more == Stream(5, 2, 17).uniforms(9)
    assert all(0 <= u < 1 for u in first + more)
    others = [Stream(5, 2, 18).uniforms(5), Stream(5, 3, 17).uniforms(5),
              Stream(6, 2, 17).uniforms(5)]
    assert all(o != first for o in others)


@pytest.mark.parametrize("n, world", [(37, 4), (40, 4), (3, 4), (10, 1)])
def test_an_epochs_order_is_dealt_out_as_distributed_sampler_deals(n, world):
    """Every rank the same number of indices, all of the dataset among them (padded from the
    start of the permutation, as DistributedSampler pads); another epoch, another order."""
    orders = [epoch_order(n, 7, 2, rank, world) for rank in range(world)]
    assert {len(o) for o in orders} == {-(-n // world)}
    dealt = [orders[r][k] for k in range(len(orders[0])) for r in range(world)]
    assert sorted(dealt[:n]) == list(range(n)) and dealt[n:] == dealt[:len(dealt) - n]
    assert orders == [epoch_order(n, 7, 2, rank, world) for rank in range(world)]
    assert n < 4 or orders != [epoch_order(n, 7, 3, rank, world) for rank in range(world)]
    sampler = EpochSampler(n, 7, 0, world)
    sampler.set_epoch(2)
    assert list(sampler) == [Sample(i, 7, 2) for i in orders[0]] and len(sampler) == len(orders[0])


def test_epoch_2s_batches_are_the_same_from_any_loader(micro_digits, tmp_path):
    """The same crops and flips ("standard") in the same order with 0, 1 or 2 worker processes,
    cached or not, from the folder or from a pack."""
    packed = tmp_path / "packed"
    shutil.copytree(micro_digits["train"], packed)
    write_pack(packed, progress=False)
    batches = {}
    for name, folder, cache, workers in (("folder, cached", micro_digits["train"], True, 0),
                                         ("folder, 1 worker", micro_digits["train"], False, 1),
                                         ("pack, 2 workers", packed, False, 2),
                                         ("pack, cached, 2 workers", packed, True, 2)):
        imdir = read_image_directory(folder)
        ds = ImageDataset(imdir, train_transform("standard", 16), cache=cache)
        assert (ds.pack is not None) == (folder == packed)
        loader, sampler = make_loader(ds, batch_size=8, workers=workers, shuffle=True, seed=3)
        sampler.set_epoch(2)
        batches[name] = list(loader)
    first, *others = batches.values()
    for name, got in batches.items():
        assert len(got) == len(first) == 5, name
        assert all(torch.equal(a, b) and torch.equal(la, lb)
                   for (a, la), (b, lb) in zip(first, got)), name
    sampler.set_epoch(3)
    assert not torch.equal(next(iter(loader))[0], first[0][0])
