"""The process's global random number generators: seeding them, and their state as plain values
and tensors (so a checkpoint holding it loads with `torch.load(weights_only=True)`).

The model's initial weights are drawn from them. The data order and augmentation are not: they are
keyed by the seed, the epoch and the image (trainer/data/draws.py), so a resumed run needs no data
generator's state. What a checkpoint keeps here is for anything else that draws from the global
generators while training (a model with dropout would).
"""

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng(device: torch.device) -> dict:
    """This process's global RNG states: python, numpy, torch, CUDA (on a GPU)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict, device: torch.device) -> None:
    """Put back what capture_rng returned (after a round trip through a file; the data loaders'
    generator states that older checkpoints also hold are not needed and left aside)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
