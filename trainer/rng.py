"""Every random number generator a training run draws from: seeding them, and their state as plain
values and tensors (so a checkpoint holding it loads with `torch.load(weights_only=True)`).

The data order and augmentation of epoch N are a function of these states and N, which is what
lets a resumed run end with the very same weights as one that never stopped.
"""

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng(generators, device: torch.device) -> dict:
    """This process's RNG states: python, numpy, torch, CUDA (on a GPU) and `generators` (the
    data loaders' torch.Generators)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "torch": torch.get_rng_state(),
             "generators": [g.get_state() for g in generators]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict, generators, device: torch.device) -> None:
    """Put back what capture_rng returned (after a round trip through a file)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    for g, s in zip(generators, state["generators"], strict=True):
        g.set_state(s)
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
