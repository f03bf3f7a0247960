"""Checkpoints and automatic resume (one process): what a checkpoint holds, atomic writes, the
fallback from a damaged file, and runs that crash, are killed or run out of disk, then resume to
the very same weights as a run that never stopped. Multi-process faults:
tests/jobs/test_faults.py."""

import errno
import io
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.paths import REPO
from helpers.runs import train_argv

from kfvision.trainer.checkpoint import (
    FOLDER,
    Checkpointer,
    CheckpointStore,
    check_writable,
    digest,
    output_error,
)
from kfvision.trainer.distributed import DistContext
from kfvision.trainer.errors import CheckpointMismatchError, OutputError
from kfvision.trainer.rng import capture_rng, restore_rng
from kfvision.trainer.train import main

CPU = torch.device("cpu")
ALONE = DistContext(0, 0, 1, 1, CPU)
# 3 short epochs on 40 images; "light" augmentation draws for every image, from a stream keyed
# by the seed, the epoch and the image (trainer/data/draws.py), so a resumed run can match bit for
# bit without any generator's state.
OPTIONS = {"epochs": 3, "image_size": 32, "batch_size": 16, "lr": 0.02, "augment": "light",
           "print_freq": 100, "workers": 0, "seed": 5}


# --- the pieces ----------------------------------------------------------------------------------


def _state(epoch=1, size=64) -> dict:
    g = torch.Generator().manual_seed(epoch)
    return {"model": {"w": torch.randn(size, generator=g), "n": torch.tensor(epoch)},
            "history": [{"epoch": epoch, "val_loss": 1.0 / epoch}], "settings": {"lr": 0.1},
            "rng": [capture_rng(CPU)], "early_stopping": {"best_loss": float("inf")}}


def test_digest_survives_save_and_load_and_notices_one_flipped_bit():
    state = _state()
    buf = io.BytesIO()
    torch.save(state, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert digest(loaded) == digest(state)
    loaded["model"]["w"][7] = torch.nextafter(loaded["model"]["w"][7], torch.tensor(10.0))
    assert digest(loaded) != digest(state)


def test_rng_states_round_trip_through_a_checkpoint_file(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    saved = capture_rng(CPU)
    draws = (random.random(), np.random.rand(), torch.rand(2))
    torch.save(saved, tmp_path / "rng.pt")
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True), CPU)
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert draws[:2] == again[:2] and torch.equal(draws[2], again[2])


def test_keeps_the_newest_two_and_the_best_and_clears_stale_temporary_files(tmp_path):
    store = CheckpointStore(tmp_path / FOLDER)
    store.write(1, _state(1), best_epoch=1)
    (store.folder / ".epoch-0002.pt.abc123").write_bytes(b"half a file")  # a killed write
    for epoch in (2, 3, 4):
        store.write(epoch, _state(epoch), best_epoch=1)
    assert sorted(p.name for p in store.folder.iterdir()) == [
        "epoch-0001.pt", "epoch-0003.pt", "epoch-0004.pt"]
    epoch, state = store.latest()
    assert epoch == 4 and digest(state) == digest(_state(4))


class _Planted:
    """A pickle that would run a command when loaded without weights_only."""

    def __reduce__(self):
        return (os.system, ("touch PLANTED",))


def _flip(data: bytes) -> bytes:  # one byte in the middle of the tensor data
    b = bytearray(data)
    b[len(b) // 2] ^= 0x01
    return bytes(b)


DAMAGE = {  # how the newest file is damaged -> what the warning says
    "empty file": (lambda data: b"", "cannot be read"),
    "truncated": (lambda data: data[: len(data) // 2], "cannot be read"),
    "garbage": (lambda data: b"not a checkpoint\n" * 100, "cannot be read"),
    "one flipped byte": (_flip, "sha256 does not match"),
    "another torch file": (lambda data: _saved({"w": torch.ones(3)}), "not a kfvision checkpoint"),
    "planted pickle": (lambda data: pickle.dumps({"x": _Planted()}), "cannot be read"),
    "another epoch's file": (lambda data: None, "expected 1 / 2"),
}


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before_with_a_warning(
        tmp_path, damage, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = CheckpointStore(tmp_path / FOLDER)
    store.write(1, _state(1), best_epoch=1)
    store.write(2, _state(2), best_epoch=2)
    change, warning = DAMAGE[damage]
    newest = store.path(2)
    data = change(newest.read_bytes())
    if data is None:  # epoch 1's file under epoch 2's name
        data = store.path(1).read_bytes()
    newest.write_bytes(data)
    epoch, state = store.latest()
    assert epoch == 1 and digest(state) == digest(_state(1))
    assert f"checkpoint {newest} " in caplog.text and warning in caplog.text
    assert "falling back" in caplog.text
    assert not (tmp_path / "PLANTED").exists()  # weights_only: a planted file runs nothing


def test_no_readable_checkpoint_means_starting_over_with_a_warning(tmp_path, caplog):
    store = CheckpointStore(tmp_path / FOLDER)
    store.folder.mkdir()
    store.path(3).write_bytes(b"")
    assert store.latest() is None and "training starts over" in caplog.text
    assert CheckpointStore(tmp_path / "none").latest() is None


def test_resuming_with_other_settings_is_refused_with_what_differs(tmp_path):
    store = CheckpointStore(tmp_path / FOLDER)
    store.write(1, {**_state(1), "settings": {"epochs": 3, "lr": 0.1, "world_size": 2}}, 1)
    ck = Checkpointer(store.folder, ALONE, {"epochs": 5, "lr": 0.1, "world_size": 1})
    with pytest.raises(CheckpointMismatchError,
                       match=r"epochs 3 \(now 5\); world_size 2 \(now 1\).*delete"):
        ck.load()


@pytest.mark.parametrize("code, message", [
    (errno.ENOSPC, "is full"), (errno.EDQUOT, "is full"), (errno.EROFS, "read-only"),
    (errno.EACCES, "not writable by this user"), (errno.EIO, "Check the volume")])
def test_write_errors_become_named_errors_that_say_what_to_do(code, message):
    e = output_error(OSError(code, os.strerror(code)), "/data/out")
    assert isinstance(e, OutputError) and e.exit_code == 4
    assert "/data/out" in str(e) and message in str(e)


def test_an_output_location_without_room_is_refused_before_training(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9, 5 * 2**20))
    with pytest.raises(OutputError, match="has 5 MiB free but .* need about 95 MiB"):
        check_writable(tmp_path / "out", 95 * 2**20)


# --- whole runs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def micro(micro_digits) -> dict:
    """4 training digits and 1 validation digit per class: 3 steps an epoch."""
    return micro_digits


@pytest.fixture(scope="module")
def reference(micro, resnet18_dir, tmp_path_factory) -> Path:
    """The run that never stops."""
    out = tmp_path_factory.mktemp("reference") / "model"
    assert main(train_argv(resnet18_dir, micro, out, **OPTIONS)) == 0
    return out


def _weights(out: Path) -> dict:
    return torch.load(out / "weights.pt", weights_only=True)


def assert_same_run(out: Path, reference: Path) -> None:
    """Same weights, bit for bit, and the same history (but for timings)."""
    a, b = _weights(out), _weights(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    timing = ("train_seconds", "train_images_per_sec")
    ours, theirs = (json.loads((p / "metrics.json").read_text()) for p in (out, reference))
    assert [{k: v for k, v in h.items() if k not in timing} for h in ours["history"]] == \
        [{k: v for k, v in h.items() if k not in timing} for h in theirs["history"]]
    assert ours["status"] == "completed"
    assert ours["final"]["val_loss"] == theirs["final"]["val_loss"]
    assert not (out / FOLDER).exists()  # a completed run leaves only the model directory


def _crash_in_epoch(monkeypatch, crash_epoch: int):
    """Make the next run die at the start of `crash_epoch` (as a killed pod would)."""
    from kfvision.trainer.engine import Trainer

    real = Trainer.train_one_epoch

    def train_one_epoch(self, epoch):
        if epoch == crash_epoch:
            raise RuntimeError("simulated crash")
        return real(self, epoch)

    monkeypatch.setattr(Trainer, "train_one_epoch", train_one_epoch)


def _run_until_it_crashes_in_epoch_3(argv, monkeypatch) -> None:
    with monkeypatch.context() as m:
        _crash_in_epoch(m, 3)
        with pytest.raises(RuntimeError, match="simulated crash"):
            main(argv)


def test_a_crashed_run_resumes_from_its_last_checkpoint_and_ends_as_if_it_never_stopped(
        tmp_path, micro, resnet18_dir, reference, monkeypatch, capsys):
    out = tmp_path / "model"
    argv = train_argv(resnet18_dir, micro, out, **OPTIONS)
    _run_until_it_crashes_in_epoch_3(argv, monkeypatch)
    assert sorted(p.name for p in (out / FOLDER).iterdir()) == ["epoch-0001.pt", "epoch-0002.pt"]
    assert json.loads((out / "metrics.json").read_text())["status"] == "failed"
    capsys.readouterr()
    assert main(argv) == 0
    log = capsys.readouterr().out
    assert f"resuming from {out / FOLDER / 'epoch-0002.pt'}: epoch 2 of 3 done" in log
    assert "epoch 1 done" not in log and "epoch 3 done" in log  # only the lost epoch again
    assert json.loads((out / "metrics.json").read_text())["resumed_from"] == [2]
    assert_same_run(out, reference)


def test_a_damaged_newest_checkpoint_costs_one_more_epoch_not_the_run(
        tmp_path, micro, resnet18_dir, reference, monkeypatch, capsys):
    out = tmp_path / "model"
    argv = train_argv(resnet18_dir, micro, out, **OPTIONS)
    _run_until_it_crashes_in_epoch_3(argv, monkeypatch)
    newest = out / FOLDER / "epoch-0002.pt"
    newest.write_bytes(_flip(newest.read_bytes()))
    capsys.readouterr()
    assert main(argv) == 0
    log = capsys.readouterr().out
    assert f"WARNING: checkpoint {newest} is damaged" in log
    assert "epoch 1 of 3 done" in log
    assert_same_run(out, reference)


KILL_DURING_WRITE = """
    import os, signal, sys
    real_fsync = os.fsync

    def fsync(fd):  # the whole file is written, not yet renamed: the worst moment to die
        if ".epoch-0002.pt." in os.readlink(f"/proc/self/fd/{fd}"):
            os.kill(os.getpid(), signal.SIGKILL)
        real_fsync(fd)

    os.fsync = fsync
    from kfvision.trainer.train import main
    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_kill_while_writing_a_checkpoint_leaves_the_previous_one_loadable(
        tmp_path, micro, resnet18_dir, reference, capsys):
    out = tmp_path / "model"
    argv = train_argv(resnet18_dir, micro, out, **OPTIONS)
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(KILL_DURING_WRITE), *argv],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == -signal.SIGKILL, run.stdout[-2000:] + run.stderr[-2000:]
    folder = out / FOLDER
    names = {p.name for p in folder.iterdir()}
    temporary = {n for n in names if n.startswith(".epoch-0002.pt.")}  # the unfinished write
    assert len(temporary) == 1 and names - temporary == {"epoch-0001.pt"}
    assert CheckpointStore(folder).latest()[0] == 1
    assert main(argv) == 0
    assert "epoch 1 of 3 done" in capsys.readouterr().out
    assert_same_run(out, reference)


def test_a_full_disk_stops_with_a_named_error_and_keeps_the_last_good_files(
        tmp_path, micro, resnet18_dir, monkeypatch, capsys):
    real_save = torch.save

    def save(obj, f, *args, **kwargs):  # runs out of space half way through epoch 2's checkpoint
        if isinstance(f, io.BufferedWriter) and \
                ".epoch-0002.pt." in os.readlink(f"/proc/self/fd/{f.fileno()}"):
            f.write(_saved(obj)[:4096])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    out = tmp_path / "model"
    assert main(train_argv(resnet18_dir, micro, out, **OPTIONS)) == 4
    err = capsys.readouterr().err
    assert "is full (No space left on device)" in err and "Traceback" not in err
    assert sorted(p.name for p in (out / FOLDER).iterdir()) == ["epoch-0001.pt"]  # no half file
    assert CheckpointStore(out / FOLDER).latest()[0] == 1
    assert _weights(out).keys()  # weights.pt of epoch 1, whole
    assert json.loads((out / "metrics.json").read_text())["status"] == "failed"


def test_a_real_full_disk_then_room_again_resumes_to_the_same_weights(
        tmpfs, micro, resnet18_dir, reference, monkeypatch, capsys):
    from helpers.machine import fill, free_up

    vol = tmpfs("640m")  # passes the check before training (10 x the model's ~45 MB)
    real_write = CheckpointStore.write

    def write(self, epoch, state, best_epoch):  # the disk fills up once epoch 1 is saved
        path = real_write(self, epoch, state, best_epoch)
        if epoch == 1:
            fill(vol, 1 << 20)
        return path

    monkeypatch.setattr(CheckpointStore, "write", write)
    out = vol / "model"
    assert main(train_argv(resnet18_dir, micro, out, **OPTIONS)) == 4
    err = capsys.readouterr().err
    assert "is full (No space left on device)" in err and "Traceback" not in err
    assert CheckpointStore(out / FOLDER).latest()[0] == 1
    assert not [p for p in out.rglob(".*")]  # no half-written file
    monkeypatch.setattr(CheckpointStore, "write", real_write)
    free_up(vol)
    assert main(train_argv(resnet18_dir, micro, out, **OPTIONS)) == 0
    assert "epoch 1 of 3 done" in capsys.readouterr().out
    assert_same_run(out, reference)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders anyway")
def test_a_read_only_output_folder_fails_before_training(tmp_path, micro, resnet18_dir, capsys):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        assert main(train_argv(resnet18_dir, micro, out / "model", **OPTIONS)) == 4
    finally:
        out.chmod(0o755)
    assert "cannot write to" in capsys.readouterr().err and list(out.iterdir()) == []


def test_a_read_only_volume_fails_before_training_and_writes_nothing(
        tmp_path, micro, resnet18_dir, monkeypatch, capsys):
    volume = tmp_path / "volume"
    volume.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):  # what a volume mounted read-only answers
        if str(path).startswith(str(volume)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    assert main(train_argv(resnet18_dir, micro, volume / "model", **OPTIONS)) == 4
    out, err = capsys.readouterr()
    assert "read-only" in err and "Give --out on a writable volume" in err
    assert "epoch 1" not in out and list(volume.iterdir()) == []


def test_a_checkpoint_of_other_settings_is_refused_before_training(
        tmp_path, micro, resnet18_dir, capsys):
    out = tmp_path / "model"
    CheckpointStore(out / FOLDER).write(1, {**_state(1), "settings": {"epochs": 9}}, 1)
    assert main(train_argv(resnet18_dir, micro, out, **OPTIONS)) == 2
    err = capsys.readouterr().err
    assert "epochs 9 (now 3)" in err and "epoch-0001.pt" in err


@pytest.mark.slow  # 3.5-5 s of CPU measured: near the unmarked limit
def test_the_weights_depend_on_no_loader_storage_or_cache_choice_nor_a_restart(
        tmp_path, micro, resnet18_dir, reference, monkeypatch):
    """The reference ran from the folders with the defaults (cache on, no workers). The same run
    from a pack, uncached, 2 workers; and one from the folders, uncached, 1 worker, killed in
    epoch 3 and resumed cached with none: the same weights, bit for bit (trainer/data/draws.py).
    """
    import shutil

    from kfvision.trainer.data.pack import write_pack

    packed = {"train": tmp_path / "packed", "val": micro["val"]}
    shutil.copytree(micro["train"], packed["train"])
    write_pack(packed["train"], progress=False)
    options = {**OPTIONS, "cache": "off"}
    out = tmp_path / "from-pack"
    assert main(train_argv(resnet18_dir, packed, out, **{**options, "workers": 2})) == 0
    fast_path = json.loads((out / "metrics.json").read_text())["fast_path"]
    assert (fast_path["cache"], fast_path["workers"]) == (False, 2)
    assert_same_run(out, reference)
    out = tmp_path / "restarted"
    _run_until_it_crashes_in_epoch_3(
        train_argv(resnet18_dir, micro, out, **{**options, "workers": 1}), monkeypatch)
    assert main(train_argv(resnet18_dir, micro, out, **{**OPTIONS, "cache": "on"})) == 0
    assert json.loads((out / "metrics.json").read_text())["resumed_from"] == [2]
    assert_same_run(out, reference)
