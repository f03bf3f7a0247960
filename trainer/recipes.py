"""The training recipe's parts the loop uses (trainer/engine.py): the optimizer and its parameter
groups, the learning-rate schedule, the batch-level augmentations (mixup, cutmix, the "strong"
preset's TrivialAugment and random erasing) and the EMA of the weights.

Each is torch's or torchvision's own (SGD/AdamW, `transforms.v2.MixUp`/`CutMix`/
`TrivialAugmentWide`/`RandomErasing`, `optim.swa_utils.AveragedModel`); what is ours is the
plumbing: the groups (no weight decay on norms and biases; the head apart, for
--freeze-backbone-epochs) and the keying of every draw by (seed, epoch, step, rank), so that a
batch's mixing does not depend on what ran before it (a resumed run draws the same).
"""

import contextlib
import math

import torch
from torch import nn

from kfvision.trainer.data.draws import stream_key  # the data's own key: one rule for draws

# the parameters of these layers, and every bias, take --norm-weight-decay
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm,
          nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm)


def _no_decay_names(model: nn.Module) -> set:
    names = set()
    for prefix, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            embedding = name.endswith(("pos_embedding", "class_token",
                                       "relative_position_bias_table"))
            if isinstance(module, _NORMS) or name == "bias" or embedding:
                names.add(full)
    return names


def param_groups(model: nn.Module, weight_decay: float, norm_weight_decay: float | None,
                 head: frozenset = frozenset()) -> list:
    """Groups of the trainable parameters: (backbone, head) x (decayed, norms and biases), the
    empty ones left out; each group says whether it is the head's (`head`: state_dict keys)."""
    plain = _no_decay_names(model) if norm_weight_decay is not None else set()
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        key = (name in head, name in plain)
        groups.setdefault(key, []).append(p)
    return [{"params": ps, "is_head": is_head,
             "weight_decay": norm_weight_decay if no_decay else weight_decay}
            for (is_head, no_decay), ps in sorted(groups.items())]


def make_optimizer(groups: list, name: str, lr: float, momentum: float):
    """SGD with momentum (its fused kernel where torch has one) or AdamW (fused likewise)."""
    for fast in ({"fused": True}, {"foreach": True}):
        try:
            if name == "adamw":
                return torch.optim.AdamW(groups, lr=lr, **fast)
            return torch.optim.SGD(groups, lr=lr, momentum=momentum, **fast)
        except RuntimeError:  # no fused kernel for this device or torch build
            continue
    raise AssertionError("foreach is always available")


def lr_factor(step: int, warmup_steps: int, total_steps: int, power: float,
              schedule: str = "poly") -> float:
    """Multiplier of the base lr at `step` (0-based): linear warm-up, then (1 - t)^power or
    cosine to 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * t))
    return max(0.0, 1.0 - t) ** power


def frozen_factor(step: int, frozen_steps: int) -> float:
    """The backbone's lr multiplier: 0 while it is frozen (only the head trains)."""
    return 0.0 if step < frozen_steps else 1.0


BATCH_STREAM = 0xBA7C4  # tags the recipe's batch draws among trainer/data/draws.py's keys


@contextlib.contextmanager
def keyed_draws(seed: int, epoch: int, step: int, rank: int):
    """torch's global generator seeded by (seed, epoch, step, rank) inside, restored after:
    torchvision's transforms draw from it, and so then draw the same for the same batch."""
    # a 5th part: the batch's stream never meets an image's (seed, epoch, index) stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_key(seed, epoch, step, rank, BATCH_STREAM))
        yield


class BatchAugment:
    """What the recipe does to a device batch: the "strong" preset per image on uint8 (before
    normalisation), then mixup/cutmix on the normalised batch and its one-hot labels."""

    def __init__(self, augment: str, mixup_alpha: float, cutmix_alpha: float,
                 num_classes: int):
        from torchvision.transforms import v2

        self.strong = augment == "strong"
        if self.strong:
            self.trivial = v2.TrivialAugmentWide()
            self.erase = v2.RandomErasing(p=0.1)
        mixers = [m for m, a in ((v2.MixUp, mixup_alpha), (v2.CutMix, cutmix_alpha)) if a]
        alphas = [a for a in (mixup_alpha, cutmix_alpha) if a]
        self.mix = (v2.RandomChoice([m(alpha=a, num_classes=num_classes)
                                     for m, a in zip(mixers, alphas, strict=True)])
                    if mixers else None)

    @property
    def active(self) -> bool:
        return self.strong or self.mix is not None

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW -> uint8 NCHW: TrivialAugment per image (strong only)."""
        if not self.strong:
            return images
        return torch.stack([self.trivial(im) for im in images])

    def normalised(self, images: torch.Tensor, labels: torch.Tensor):
        """(images, targets): random erasing per image (strong), then mixup or cutmix (targets
        then class probabilities, else the labels)."""
        if self.strong:
            images = torch.stack([self.erase(im) for im in images])
        if self.mix is None:
            return images, labels
        return self.mix(images, labels)


def data_preset(augment: str) -> str:
    """The data pipeline's preset of a training preset: "strong" crops as "standard" does."""
    return "standard" if augment == "strong" else augment


def make_ema(model: nn.Module, decay: float):
    """An exponential moving average of `model`'s parameters and buffers (torch's own), or None
    for decay 0."""
    if not decay:
        return None
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
