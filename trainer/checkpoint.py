"""Checkpoints: the whole training state after every epoch, and resuming from it automatically.

    <out>/checkpoints/epoch-0003.pt     the state after epoch 3

A checkpoint holds the trainer's `state_dict()` (the unwrapped model, the optimizer, the LR
schedule, the early stopping, the epoch and history, every rank's RNG states: Trainer.state_dict)
and the settings a resumed run must share. This module only saves, loads, verifies and rotates
those dicts; what is in them is the trainer's business. A restarted run (a PyTorchJob pod
recreated after a lost peer, an OOM kill, a preemption) finds the newest readable one in its
output folder and carries on from the next epoch, so at most one epoch of work is lost; on CPU
it then ends with the very same weights.

Written by rank 0 alone, atomically: a temporary file in the same folder, fsync, rename, fsync of
the folder, so a reader sees a whole file or none. Kept: the newest two and the best epoch's, so a
damaged newest file leaves an older one to fall back to (with a warning). Read by rank 0 alone and
broadcast, so worker pods need not see the folder. Every file carries a sha256 of its contents
(`torch.load` does not notice a flipped byte) and is read with `torch.load(weights_only=True)`, so
a planted file cannot run code. When the run completes, the folder is removed: the model directory
is the result.
"""

import errno
import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from kfvision.trainer.distributed import DistContext, broadcast_object, on_main
from kfvision.trainer.errors import CheckpointMismatchError, OutputError
from kfvision.trainer.model.trained import atomic_torch_save

log = logging.getLogger("trainer")

FORMAT = "kfvision.checkpoint"
VERSION = 1
FOLDER = "checkpoints"
KEEP = 2  # newest files kept besides the best epoch's
_NAME = re.compile(r"epoch-(\d+)\.pt")
# TrainConfig fields that change the arithmetic of training (the LR schedule, the data order, the
# augmentation): a run resumed with other values would be neither run. Paths, print frequency,
# workers and the like may change between restarts.
MUST_MATCH = ("epochs", "batch_size", "warmup_epochs", "lr", "seed", "image_size", "augment",
              "momentum", "weight_decay", "lr_decay_power", "recipe", "optimizer",
              "lr_schedule", "label_smoothing", "mixup_alpha", "cutmix_alpha", "ema_decay",
              "freeze_backbone_epochs", "norm_weight_decay")


def output_weights(state: dict, epoch: int) -> dict:
    """The weights a checkpoint's epoch output: the model's, or its EMA's where the EMA
    validated better (the epoch's history entry says which)."""
    if state["history"][epoch - 1].get("weights") != "ema":
        return state["model"]
    return {k.removeprefix("module."): v for k, v in state["ema"].items()
            if k.startswith("module.")}


class CorruptCheckpointError(Exception):
    """A checkpoint file cannot be used (internal: the caller falls back to an older one)."""


def digest(obj) -> str:
    """sha256 over a nest of dicts, lists, tuples, tensors and plain values (order-independent
    for dict keys), equal before torch.save and after torch.load."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h, obj) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            _feed(h, k)
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _feed(h, v)
        h.update(b"]")
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def output_error(e: OSError, where) -> OutputError:
    """A named error for a failed write, saying what to do (the caller raises it `from e`)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(f"the volume holding {where} is full ({e.strerror}). Free some space "
                           "or give --out on a volume with more room; the files written before "
                           "(weights.pt, the last checkpoint) are intact.")
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return OutputError(f"cannot write to {where} ({e.strerror}): the location is read-only "
                           "or not writable by this user. Give --out on a writable volume (in a "
                           "PyTorchJob: a PVC mounted read-write, writable by the pods' uid).")
    return OutputError(f"cannot write to {where}: {e}. Check the volume, then run again: the "
                       "run resumes from the last checkpoint.")


class CheckpointStore:
    """The checkpoint files in one folder (rank 0's side: it alone reads and writes them)."""

    def __init__(self, folder, keep: int = KEEP):
        self.folder, self.keep = Path(folder), keep

    def path(self, epoch: int) -> Path:
        return self.folder / f"epoch-{epoch:04d}.pt"

    def epochs(self) -> list:
        """Epochs that have a checkpoint file, newest first."""
        if not self.folder.is_dir():
            return []
        found = (_NAME.fullmatch(p.name) for p in self.folder.iterdir())
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def write(self, epoch: int, state: dict, best_epoch: int) -> Path:
        """Write the state after `epoch`, then drop what is no longer kept."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(epoch)
        atomic_torch_save({"format": FORMAT, "version": VERSION, "epoch": epoch,
                           "sha256": digest(state), "state": state}, path)
        self.prune(best_epoch)
        return path

    def read(self, epoch: int) -> dict:
        """The state saved after `epoch`. Raises CorruptCheckpointError with the reason."""
        path = self.path(epoch)
        try:
            doc = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure to read means: do not use this file
            raise CorruptCheckpointError(f"cannot be read ({type(e).__name__}: "
                                         f"{str(e).splitlines()[0] if str(e) else 'empty'})"
                                         ) from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CorruptCheckpointError("is not a kfvision checkpoint")
        if doc.get("version") != VERSION or doc.get("epoch") != epoch:
            raise CorruptCheckpointError(f"has version {doc.get('version')} / epoch "
                                         f"{doc.get('epoch')}, expected {VERSION} / {epoch}")
        if digest(doc.get("state")) != doc.get("sha256"):
            raise CorruptCheckpointError("is damaged (its sha256 does not match its contents)")
        return doc["state"]

    def latest(self):
        """(epoch, state) of the newest readable checkpoint, or None. Skipping a damaged one is
        logged as a warning: the run then repeats more than one epoch."""
        skipped = []
        for epoch in self.epochs():
            try:
                state = self.read(epoch)
            except CorruptCheckpointError as e:
                log.warning("WARNING: checkpoint %s %s; falling back to the one before",
                            self.path(epoch), e)
                skipped.append(epoch)
                continue
            return epoch, state
        if skipped:
            log.warning("WARNING: no readable checkpoint in %s: training starts over", self.folder)
        return None

    def prune(self, best_epoch: int) -> None:
        """Keep the newest `keep` files and the best epoch's; remove the rest and stale temporary
        files (a write killed half way leaves one)."""
        epochs = self.epochs()
        keep = set(epochs[:self.keep]) | {best_epoch}
        for epoch in epochs:
            if epoch not in keep:
                self.path(epoch).unlink(missing_ok=True)
        for p in self.folder.glob(".epoch-*.pt.*"):
            p.unlink(missing_ok=True)

    def remove(self) -> None:
        """Delete the folder (the run completed: the model directory is the result)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def check_writable(out: Path, need_bytes: int) -> None:
    """Fail now, not after an epoch, when `out` cannot take the checkpoints and the model."""
    folder = out / FOLDER
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise output_error(e, out) from e
    used = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    free = shutil.disk_usage(folder).free
    if free + used < need_bytes:
        raise OutputError(f"{out} has {free / 2**20:.0f} MiB free but checkpoints and the model "
                          f"need about {need_bytes / 2**20:.0f} MiB. Free some space or give "
                          "--out on a bigger volume.")


class Checkpointer:
    """Saving and loading state dicts, called by every rank (collectives); files only on rank 0.

    A state is a dict of tensors and plain values with an "epoch" (the epoch it is the state after)
    and a "model" entry (the weights, for the best epoch's model on resume).

    Args:
        folder: where the checkpoint files go (<out>/checkpoints).
        ctx: this process's place in the job.
        settings: what a resumed run must share with the one that wrote the checkpoint (the
            MUST_MATCH config values, world size, architecture, classes); saved in every file.

    `extra`: plain values kept in every later file and read back by `saved()` (the MLflow run id,
    so a resumed run continues the same run); unlike `settings`, they need not match.
    """

    def __init__(self, folder, ctx: DistContext, settings: dict):
        self.store, self.ctx, self.settings = CheckpointStore(folder), ctx, settings
        self.extra = {}

    def saved(self, key: str):
        """The value of `extra[key]` in the newest readable checkpoint (rank 0; None elsewhere,
        or without one)."""
        found = self.store.latest() if self.ctx.is_main else None
        return None if found is None else found[1].get("extra", {}).get(key)

    def path(self, epoch: int) -> Path:
        """The file of the checkpoint after `epoch` (for messages)."""
        return self.store.path(epoch)

    def save(self, state: dict, best_epoch: int) -> None:
        """Write `state` (with the settings) on rank 0, keeping the newest files and best_epoch's.

        Raises:
            OutputError: on every rank, when the file cannot be written (full, read-only).
        """
        def write():
            try:
                self.store.write(state["epoch"], {**state, "settings": self.settings,
                                                  "extra": dict(self.extra)}, best_epoch)
            except OSError as e:
                raise output_error(e, self.store.folder) from e

        on_main(self.ctx, write)

    def _latest(self):
        found = self.store.latest()
        if found is not None:
            epoch, state = found
            theirs = state.get("settings", {})
            diff = [f"{k} {theirs.get(k)!r} (now {v!r})" for k, v in self.settings.items()
                    if theirs.get(k) != v]
            if diff:
                raise CheckpointMismatchError(
                    f"{self.store.path(epoch)} was written by a run with other settings: "
                    f"{'; '.join(diff)}. A run resumes only with the same settings: run it with "
                    f"them again, or, to start over, delete {self.store.folder} or give "
                    "another --out.")
        return found

    def load(self) -> dict | None:
        """The newest readable checkpoint's state on every rank (read by rank 0 and broadcast, so
        workers need not see the folder), or None when there is none.

        Raises:
            CheckpointMismatchError: the checkpoint is from a run with other settings.
        """
        found = broadcast_object(on_main(self.ctx, self._latest), self.ctx)
        return None if found is None else found[1]

    def best_model(self, state: dict, best_epoch: int) -> dict | None:
        """The model state of `best_epoch` on rank 0 (from `state` when it is that epoch's), None on
        the other ranks or when that file is unreadable (with a warning)."""
        if not self.ctx.is_main:
            return None
        if best_epoch == state["epoch"]:
            return output_weights(state, best_epoch)
        try:
            return output_weights(self.store.read(best_epoch), best_epoch)
        except CorruptCheckpointError as e:
            log.warning("WARNING: the best epoch's checkpoint %s %s; weights.pt is left as it is",
                        self.store.path(best_epoch), e)
            return None

    def finish(self) -> None:
        """The run completed: remove the checkpoints (rank 0)."""
        on_main(self.ctx, self.store.remove)
