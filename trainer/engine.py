"""The DDP training loop: one Trainer with `train_one_epoch`, `evaluate` and `fit`.

Semantics (Azure ML designer's Train PyTorch Model, `--recipe azure`): SGD with momentum; learning
rate x world size; linear warm-up then polynomial decay, stepped every iteration; validation every
epoch; early stop after `patience` epochs without a decrease of the validation loss; the best
epoch's weights are the output. Other recipes (trainer/recipes.py) change the optimizer, the
decay, the loss's label smoothing, mix batches, freeze the backbone for the first epochs and keep
an EMA of the weights, validated beside them: the better of the two is the epoch's output.
Metrics are summed over all processes; only rank 0 logs and writes.
"""

import functools
import hashlib
import logging
import math
import time

import torch
from torch import nn

from kfvision.trainer.config import TrainConfig
from kfvision.trainer.data.transforms import Normalizer
from kfvision.trainer.distributed import (
    DistContext,
    all_gather_object,
    all_reduce_sum,
    broadcast_buffers,
    on_main,
    wrap_model,
)
from kfvision.trainer.errors import NonFiniteLossError
from kfvision.trainer.fastpath import FastPath
from kfvision.trainer.model.convgemm import train_only_live_taps, use_gemm_for_single_pixel_outputs
from kfvision.trainer.recipes import (
    BatchAugment,
    frozen_factor,
    keyed_draws,
    lr_factor,
    make_ema,
    make_optimizer,
    param_groups,
)
from kfvision.trainer.rng import capture_rng, restore_rng

log = logging.getLogger("trainer")


def state_digest(model: nn.Module) -> str:
    """sha256 over every parameter and buffer: equal on all ranks when DDP kept them in sync."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def make_sgd(model: nn.Module, lr: float, momentum: float, weight_decay: float):
    """SGD with its fused kernel: one pass over each parameter, its gradient and its momentum.

    The multi-tensor ("foreach") step reads and writes every parameter-sized tensor three times
    (weight decay, momentum, update), the fused kernel once (what that saves on CPU:
    docs/benchmarks.md#why-it-is-faster, "The fused SGD step"). Same update rule, rounding
    differences only.
    Torch builds without a fused kernel for the device fall back to foreach.
    """
    params = list(model.parameters())
    try:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                               fused=True)
    except RuntimeError:  # fused SGD needs torch >= 2.4 on CPU; some devices never have it
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                               foreach=True)


class EarlyStopping:
    """Stop after `patience` epochs in a row without a new lowest validation loss."""

    def __init__(self, patience: int):
        self.patience, self.best_loss, self.best_epoch, self.bad_epochs = patience, math.inf, 0, 0

    def step(self, epoch: int, val_loss: float) -> bool:
        """Record an epoch; True when it is the best so far."""
        if val_loss < self.best_loss:
            self.best_loss, self.best_epoch, self.bad_epochs = val_loss, epoch, 0
            return True
        self.bad_epochs += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.bad_epochs >= self.patience

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


class Trainer:
    """Trains `model` on `train_loader`, validating on `val_loader` every epoch.

    `on_epoch(history, best_state)` is called on rank 0 after each epoch (to write metrics and the
    best weights as they come, so nothing is lost if a later epoch fails). What a restarted run
    needs to go on is `state_dict()`; a checkpointer (kfvision.trainer.checkpoint) stores it.
    """

    def __init__(self, cfg: TrainConfig, ctx: DistContext, model: nn.Module, train_loader,
                 val_loader, train_sampler=None, normalizer: Normalizer | None = None,
                 runtime: FastPath | None = None, *, num_classes: int | None = None,
                 head: frozenset = frozenset()):
        cfg = cfg.resolved()
        self.cfg, self.ctx = cfg, ctx
        self.train_loader, self.val_loader, self.train_sampler = (train_loader, val_loader,
                                                                  train_sampler)
        self.normalize = normalizer or Normalizer()
        rt = runtime or FastPath(cache=False, workers=0, amp=False, channels_last=False,
                                 compile=False)
        self.memory_format = torch.channels_last if rt.channels_last else torch.contiguous_format
        self.amp = rt.amp
        model = model.to(ctx.device, memory_format=self.memory_format)
        if rt.conv_gemm:
            use_gemm_for_single_pixel_outputs(model)
            train_only_live_taps(model, cfg.image_size)
        self.raw_model = model
        example = torch.zeros(1, 3, cfg.image_size, cfg.image_size, device=ctx.device)
        ddp = wrap_model(model, ctx, example.contiguous(memory_format=self.memory_format),
                         self._autocast)
        self.model = torch.compile(ddp) if rt.compile else ddp
        self.eval_model = torch.compile(model) if rt.compile else model
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.val_criterion = nn.CrossEntropyLoss()
        self.lr = cfg.lr * ctx.world_size  # linear scaling rule: lr x number of processes
        groups = param_groups(model, cfg.weight_decay, cfg.norm_weight_decay, head)
        self.optimizer = make_optimizer(groups, cfg.optimizer, self.lr, cfg.momentum)
        steps = len(train_loader)

        def factor(s, frozen=0):
            return (lr_factor(s, cfg.warmup_epochs * steps, cfg.epochs * steps,
                              cfg.lr_decay_power, cfg.lr_schedule) * frozen_factor(s, frozen))
        frozen = cfg.freeze_backbone_epochs * steps if head else 0
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, [functools.partial(factor, frozen=0 if g["is_head"] else frozen)
                             for g in groups])
        self.augment = BatchAugment(cfg.augment, cfg.mixup_alpha, cfg.cutmix_alpha,
                                    num_classes or 0)
        self.ema = make_ema(model, cfg.ema_decay)
        self.topk = 5  # at most: fewer classes, fewer (_counts)
        self.stopper = EarlyStopping(cfg.patience)
        self.epoch, self.history, self.resumed_from = 0, [], []  # epochs done; checkpoints used

    def state_dict(self) -> dict:
        """Everything a restarted run needs to end as if it never stopped: the epochs done and
        their history, the unwrapped model, optimizer, schedule, early stopping, and the global
        RNG states of every rank, in rank order (the data's draws need none: they are keyed by
        the epoch, trainer/data/draws.py).

        A collective: every rank calls it (each contributes its RNG states); all get the same.
        """
        rng = all_gather_object(capture_rng(self.ctx.device), self.ctx)
        return {"epoch": self.epoch, "history": list(self.history),
                "resumed_from": list(self.resumed_from), "model": self.raw_model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "early_stopping": self.stopper.state_dict(), "rng": rng,
                **({"ema": self.ema.state_dict()} if self.ema is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (what state_dict returned, maybe from a file): this rank takes its
        own RNG states; the run is recorded as resumed from state's epoch."""
        self.raw_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.stopper.load_state_dict(state["early_stopping"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        restore_rng(state["rng"][self.ctx.rank], self.ctx.device)
        self.epoch, self.history = state["epoch"], list(state["history"])
        self.resumed_from = [*state["resumed_from"], state["epoch"]]

    def _autocast(self):
        """bf16 autocast when the runtime says so; weights and optimiser stay float32."""
        return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.amp)

    def _to_device(self, images, labels):
        nb = self.ctx.device.type == "cuda"
        images = images.to(self.ctx.device, non_blocking=nb)
        return self.normalize(images, self.memory_format), labels.to(self.ctx.device,
                                                                     non_blocking=nb)

    def _train_batch(self, images, labels, epoch: int, step: int):
        """(normalised images, loss targets, labels) of a training batch: the recipe's batch
        augmentation drawn from (seed, epoch, step, rank), not from what ran before."""
        if not self.augment.active:
            images, labels = self._to_device(images, labels)
            return images, labels, labels
        with keyed_draws(self.cfg.seed, epoch, step, self.ctx.rank):
            images = self.augment.pixels(images.to(self.ctx.device))
            images, labels = self._to_device(images, labels)
            mixed, targets = self.augment.normalised(images, labels)
        return mixed.contiguous(memory_format=self.memory_format), targets, labels

    def _counts(self, logits, labels, loss) -> torch.Tensor:
        """[loss sum, top-1 hits, top-k hits, images] of one batch, as one tensor."""
        top = logits.topk(min(self.topk, logits.shape[1]), dim=1).indices
        hits = top.eq(labels.unsqueeze(1))
        n = labels.numel()
        return torch.stack([loss.detach() * n, hits[:, 0].sum(), hits.any(dim=1).sum(),
                            torch.tensor(n, device=labels.device)]).double()

    def _global(self, sums: torch.Tensor) -> dict:
        s = all_reduce_sum(sums.clone(), self.ctx).tolist()
        n = max(s[3], 1)
        return {"loss": s[0] / n, "top1": s[1] / n, "top5": s[2] / n, "images": int(s[3])}

    def _check_finite(self, loss: float, epoch: int, step: int) -> None:
        if not math.isfinite(loss):
            raise NonFiniteLossError(
                f"the training loss became {loss} at epoch {epoch}, step {step} (learning rate "
                f"{self.scheduler.get_last_lr()[0]:.3g} = {self.cfg.lr:g} x {self.ctx.world_size} "
                "processes). Lower --lr (e.g. by 10x), add --warmup-epochs, or check the images."
            )

    def train_one_epoch(self, epoch: int) -> dict:
        self.model.train()
        if self.train_sampler is not None:
            self.train_sampler.set_epoch(epoch)
        begin = getattr(self.train_loader.dataset, "begin_epoch", None)
        if begin is not None:  # files fetched as they are read: the fetcher's cue
            begin(epoch, self.ctx.rank)
        sums = torch.zeros(4, dtype=torch.float64, device=self.ctx.device)
        steps = len(self.train_loader)
        start = last = time.perf_counter()
        last_images = 0
        for step, (images, labels) in enumerate(self.train_loader, 1):
            images, targets, labels = self._train_batch(images, labels, epoch, step)
            with self._autocast():
                logits = self.model(images)
                loss = self.criterion(logits.float(), targets)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            if self.ema is not None:
                self.ema.update_parameters(self.raw_model)
            sums += self._counts(logits.detach(), labels, loss)
            if step % self.cfg.print_freq == 0 or step == steps:
                m = self._global(sums)  # also how every rank learns of a NaN on any rank
                self._check_finite(m["loss"], epoch, step)
                now = time.perf_counter()
                rate = (m["images"] - last_images) / max(now - last, 1e-9)
                last, last_images = now, m["images"]
                if self.ctx.is_main:
                    log.info("epoch %d [%*d/%d]  loss %.4f  top1 %.4f  top5 %.4f  %.1f img/s  "
                             "lr %.3g", epoch, len(str(steps)), step, steps, m["loss"], m["top1"],
                             m["top5"], rate, self.scheduler.get_last_lr()[0])
        broadcast_buffers(self.raw_model, self.ctx)
        m = self._global(sums)
        m["seconds"] = time.perf_counter() - start
        m["images_per_sec"] = m["images"] / max(m["seconds"], 1e-9)
        return m

    @torch.inference_mode()
    def evaluate(self, model: nn.Module | None = None) -> dict:
        """Validation figures of the model (or of `model`, e.g. the EMA's)."""
        self.model.eval()
        net = self.eval_model if model is None else model.eval()
        sums = torch.zeros(4, dtype=torch.float64, device=self.ctx.device)
        for images, labels in self.val_loader:
            images, labels = self._to_device(images, labels)
            with self._autocast():
                logits = net(images).float()  # no DDP in eval: no collectives
            sums += self._counts(logits, labels, self.val_criterion(logits, labels))
        return self._global(sums)

    def _validate(self) -> tuple[dict, dict | None]:
        """(the figures of the epoch's output weights, the EMA's extra entries or None): with an
        EMA, the better of the weights and their average (validation loss)."""
        va = self.evaluate()
        if self.ema is None:
            return va, None
        ve = self.evaluate(self.ema.module)
        chosen = ve["loss"] < va["loss"]
        extra = {"weights": "ema" if chosen else "model", "val_loss_model": va["loss"],
                 "val_top1_model": va["top1"], "val_loss_ema": ve["loss"],
                 "val_top1_ema": ve["top1"]}
        return (ve if chosen else va), extra

    def _output_state(self, extra) -> dict:
        net = self.ema.module if extra and extra["weights"] == "ema" else self.raw_model
        return {k: v.detach().to("cpu", copy=True) for k, v in net.state_dict().items()}

    def _resume(self, checkpointer, on_epoch) -> None:
        """Go on from the checkpointer's newest state, if it has one."""
        state = checkpointer.load()
        if state is None:
            return
        self.load_state_dict(state)
        best_state = checkpointer.best_model(state, self.stopper.best_epoch)
        if self.ctx.is_main:
            log.info("resuming from %s: epoch %d of %d done (best so far: epoch %d); training "
                     "goes on from epoch %d", checkpointer.path(self.epoch), self.epoch,
                     self.cfg.epochs, self.stopper.best_epoch, self.epoch + 1)
        if on_epoch:  # weights.pt and metrics.json as of that epoch
            on_main(self.ctx, lambda: on_epoch(self.history, best_state))

    def fit(self, on_epoch=None, checkpointer=None) -> dict:
        """Train until the last epoch or early stop; returns the summary (best epoch etc.).

        With a `checkpointer` (kfvision.trainer.checkpoint), a run first resumes from the newest
        readable
        checkpoint, and saves one after every epoch."""
        cfg, stopper, best_state = self.cfg, self.stopper, None
        if checkpointer is not None:  # a restarted run goes on from its last checkpoint
            self._resume(checkpointer, on_epoch)
        while self.epoch < cfg.epochs and not stopper.should_stop:
            epoch = self.epoch + 1
            lr = self.scheduler.get_last_lr()[0]
            tr = self.train_one_epoch(epoch)
            va, extra = self._validate()
            self.history.append({
                "epoch": epoch, "lr": lr, "train_loss": tr["loss"], "train_top1": tr["top1"],
                "train_top5": tr["top5"], "train_images_per_sec": tr["images_per_sec"],
                "train_seconds": tr["seconds"], "val_loss": va["loss"], "val_top1": va["top1"],
                "val_top5": va["top5"], **(extra or {})})
            self.epoch = epoch
            improved = stopper.step(epoch, va["loss"])
            if improved:
                best_state = self._output_state(extra)
            if checkpointer is not None:  # first: weights.pt is rewritten from it on resume
                checkpointer.save(self.state_dict(), stopper.best_epoch)
            if self.ctx.is_main:
                log.info("epoch %d done: train loss %.4f top1 %.4f | val loss %.4f top1 %.4f "
                         "top5 %.4f | %.1f img/s%s", epoch, tr["loss"], tr["top1"], va["loss"],
                         va["top1"], va["top5"], tr["images_per_sec"],
                         "  (best so far)" if improved else "")
            if on_epoch:
                on_main(self.ctx, lambda b=best_state if improved else None:
                        on_epoch(self.history, b))
            if stopper.should_stop and epoch < cfg.epochs and self.ctx.is_main:
                log.info("early stop: validation loss has not decreased for %d epoch(s); "
                         "best epoch %d", cfg.patience, stopper.best_epoch)
        self._check_replicas()
        return self._summary(best_state)

    def _check_replicas(self) -> None:
        digests = all_gather_object(state_digest(self.raw_model), self.ctx)
        if len(set(digests)) != 1:  # DDP must keep replicas identical; anything else is a bug
            raise RuntimeError(f"model replicas diverged across ranks: {digests}")
        if self.ctx.is_main:
            log.info("weights identical on all %d rank(s) (sha256 %s)", len(digests),
                     digests[0][:16])

    def _summary(self, best_state) -> dict:
        history, best_epoch = self.history, self.stopper.best_epoch
        best = history[best_epoch - 1]
        seconds = sum(h["train_seconds"] for h in history)
        images = sum(h["train_images_per_sec"] * h["train_seconds"] for h in history)
        return {"history": history, "best_epoch": best_epoch, "epochs_run": len(history),
                "stopped_early": len(history) < self.cfg.epochs,
                "world_size": self.ctx.world_size, "resumed_from": self.resumed_from,
                "final": {"val_loss": best["val_loss"], "val_top1": best["val_top1"],
                          "val_top5": best["val_top5"],
                          "train_images_per_sec": images / max(seconds, 1e-9)},
                "best_state": best_state}
