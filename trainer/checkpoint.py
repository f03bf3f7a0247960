"""Checkpoints: the whole training state after every epoch, and resuming from it automatically.

    <out>/checkpoints/epoch-0003.pt     the state after epoch 3

A checkpoint holds the (unwrapped) model, the optimizer, the LR schedule, the early-stopping state,
the epoch and history, the RNG states of every rank (python, numpy, torch, CUDA and the data
loaders' generators: the data order of epoch N is a function of those and N), and the settings a
resumed run must share. A restarted run (a PyTorchJob pod recreated after a lost peer, an OOM kill,
a preemption) finds the newest readable one in its output folder and carries on from the next
epoch, so at most one epoch of work is lost; on CPU it then ends with the very same weights.

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
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from trainer.distributed import DistContext, all_gather_object, broadcast_object
from trainer.errors import CheckpointMismatchError, KfvisionError, OutputError
from trainer.model.trained import atomic_torch_save

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
              "momentum", "weight_decay", "lr_decay_power")


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


def capture_rng(generators, device: torch.device) -> dict:
    """This process's RNG states, as plain values and tensors (loadable with weights_only)."""
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


def on_main(ctx: DistContext, fn):
    """Run fn() on rank 0; a KfvisionError it raises is raised on every rank (so that no rank
    waits forever in a collective for one that has failed). Returns fn's result on rank 0."""
    result, error = None, None
    if ctx.is_main:
        try:
            result = fn()
        except KfvisionError as e:
            error = e
    error = broadcast_object(error, ctx)
    if error is not None:
        raise error
    return result


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
    """Saving and resuming, called by every rank (collectives); files only on rank 0.

    Args:
        folder: where the checkpoint files go (<out>/checkpoints).
        ctx: this process's place in the job.
        settings: what a resumed run must share with the one that wrote the checkpoint (the
            MUST_MATCH config values, world size, architecture, classes).
    """

    def __init__(self, folder, ctx: DistContext, settings: dict):
        self.store, self.ctx, self.settings = CheckpointStore(folder), ctx, settings

    def save(self, trainer, epoch: int, stopper, history: list, resumed: list) -> None:
        rngs = all_gather_object(capture_rng(_generators(trainer), self.ctx.device), self.ctx)

        def write():
            state = {"epoch": epoch, "settings": self.settings, "history": history,
                     "resumed_from": resumed,
                     "model": trainer.raw_model.state_dict(),
                     "optimizer": trainer.optimizer.state_dict(),
                     "scheduler": trainer.scheduler.state_dict(),
                     "early_stopping": dict(vars(stopper)), "rng": rngs}
            try:
                self.store.write(epoch, state, stopper.best_epoch)
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

    def resume(self, trainer, stopper) -> tuple:
        """Load the newest readable checkpoint into `trainer` and `stopper`, if there is one.

        Returns:
            (first epoch to run, history, the best epoch's model state on rank 0 (or None),
            the epochs resumed from so far).
        Raises:
            CheckpointMismatchError: the checkpoint is from a run with other settings.
        """
        found = broadcast_object(on_main(self.ctx, self._latest), self.ctx)
        if found is None:
            return 1, [], None, []
        epoch, state = found
        trainer.raw_model.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.scheduler.load_state_dict(state["scheduler"])
        vars(stopper).update(state["early_stopping"])
        restore_rng(state["rng"][self.ctx.rank], _generators(trainer), self.ctx.device)
        resumed = [*state["resumed_from"], epoch]
        best = None
        if self.ctx.is_main:
            best = self._best_model(state, epoch, stopper.best_epoch)
            log.info("resuming from %s: epoch %d of %d done (best so far: epoch %d); training "
                     "goes on from epoch %d", self.store.path(epoch), epoch, trainer.cfg.epochs,
                     stopper.best_epoch, epoch + 1)
        start = trainer.cfg.epochs + 1 if stopper.should_stop else epoch + 1
        return start, state["history"], best, resumed

    def _best_model(self, state: dict, epoch: int, best_epoch: int):
        if best_epoch == epoch:
            return state["model"]
        try:
            return self.store.read(best_epoch)["model"]
        except CorruptCheckpointError as e:
            log.warning("WARNING: the best epoch's checkpoint %s %s; weights.pt is left as it is",
                        self.store.path(best_epoch), e)
            return None

    def finish(self) -> None:
        """The run completed: remove the checkpoints (rank 0)."""
        if self.ctx.is_main:
            self.store.remove()


def _generators(trainer) -> list:
    return [g for g in (getattr(trainer.train_loader, "generator", None),
                        getattr(trainer.val_loader, "generator", None)) if g is not None]
