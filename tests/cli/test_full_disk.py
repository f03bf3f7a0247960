"""A full disk at every write site, on a real small filesystem (a tmpfs, mounted as root; the
tests skip, saying why, where it cannot be mounted) that fills up mid-write: each ends in one
named line (OutputError, exit 4) naming the path, nothing half-written under a final name, and
the previous result intact. The commands run as a user runs them: `python -m kfvision.pipelines.cli`
in a
subprocess, so the exit code and the one line (no traceback) are what a user gets."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.machine import fill, free_up
from helpers.paths import REPO

from kfvision.pipelines.clients import s3, s3sync
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.errors import OutputError
from kfvision.trainer.fileio import atomic_write_bytes


def kfvision(*argv, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kfvision.pipelines.cli", *map(str, argv)],
                          cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def assert_full_disk_line(run, path) -> None:
    """Exit 4, and stderr's last line is the one named error naming `path` (no traceback)."""
    assert run.returncode == 4, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("error: OutputError: the volume holding ") and str(path) in line, line
    assert "is full (No space left on device" in line and "free" in line


def leftovers(folder: Path) -> list:
    """Temporary files and folders (hidden names) anywhere under `folder`."""
    return sorted(p.name for p in folder.rglob(".*"))


def test_atomic_write_on_a_full_disk_names_the_path_and_keeps_the_old_file(tmpfs):
    vol = tmpfs("1m")
    atomic_write_bytes(vol / "metrics.json", b"old\n")
    fill(vol, 64 << 10)
    with pytest.raises(OutputError, match=r"the volume holding .*metrics\.json is full \(No space "
                       r"left on device\): [\d.]+ MiB free, about 0\.2 MiB needed\. "):
        atomic_write_bytes(vol / "metrics.json", b"x" * (200 << 10))
    assert (vol / "metrics.json").read_bytes() == b"old\n" and leftovers(vol) == []


def test_convert_on_a_full_disk(tmpfs, tiny_digits):
    from kfvision.trainer.data.convert import convert

    vol = tmpfs("2m")
    out = vol / "val"
    convert(tiny_digits["raw"] / "val", out, progress=False)
    before = read_image_directory(out, verify="hash").images
    fill(vol, 80 << 10)  # the copy of 60 images (~240 KiB on a tmpfs) fills it
    run = kfvision("convert", tiny_digits["raw"] / "val", out, "--quiet", "--overwrite")
    assert_full_disk_line(run, out)
    assert "needed" in run.stderr  # a copy knows the bytes it copies
    assert read_image_directory(out, verify="hash").images == before  # previous result intact
    assert leftovers(vol) == []  # no staging folder, no temporary file
    with pytest.raises(OutputError, match=f"the volume holding {vol / 'new'} is full"):
        convert(tiny_digits["raw"] / "val", vol / "new", progress=False)
    assert not (vol / "new").exists() and leftovers(vol) == []


@pytest.mark.slow
def test_score_out_on_a_full_disk(tmpfs, trained_tiny, tiny_digits):
    vol = tmpfs("1m")
    out = vol / "scored.csv"
    out.write_text("the previous table\n")
    fill(vol, 4 << 10)
    run = kfvision("score", "--model", trained_tiny, "--data", tiny_digits["val"], "--out", out,
                   "--quiet")
    assert_full_disk_line(run, out)
    assert out.read_text() == "the previous table\n" and leftovers(vol) == []


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torchscript", "torch-export"])
def test_export_on_a_full_disk(tmpfs, trained_tiny, fmt):
    vol = tmpfs("16m")  # a resnet18 is ~45 MB: it cannot fit
    out = vol / "model.pt"
    out.write_bytes(b"the previous export")
    run = kfvision("export", "--model", trained_tiny, "--format", fmt, "--out", out)
    assert_full_disk_line(run, out)
    assert out.read_bytes() == b"the previous export" and leftovers(vol) == []


@pytest.mark.process
def test_an_s3_fetch_on_a_full_disk_resumes_once_there_is_room(tmpfs, s3_bucket, tiny_digits):
    n = s3_bucket.upload_folder(tiny_digits["raw"] / "val", "v/")
    vol = tmpfs("2m")
    out, place = vol / "val", vol / "val.fetched"
    fill(vol, 120 << 10)
    run = kfvision("convert", s3_bucket.uri("v/"), out, "--quiet", "--max-connections", "1")
    assert run.returncode == 4, run.stderr[-3000:]
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("error: OutputError: the volume holding ") and str(place) in line
    assert "Traceback" not in run.stderr and not out.exists()
    lines = (place / s3sync.JOURNAL).read_text().splitlines()[1:]
    done = [json.loads(x) for x in lines if x.endswith("}")]
    assert done, "nothing fetched before the disk filled: fill less"
    for d in done:  # whatever the journal lists is whole
        assert (place / d["path"]).stat().st_size == d["bytes"]
    assert not list(place.rglob(f"{s3.PART}*"))
    free_up(vol)
    run = kfvision("convert", s3_bucket.uri("v/"), out, "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"downloaded {n - len(done)} " in run.stdout
    assert len(read_image_directory(out, verify="hash").images) == n


def test_the_model_cache_on_a_full_disk_resumes_once_there_is_room(tmpfs, s3_bucket):
    for i in range(30):
        s3_bucket.put(f"m/part-{i:02d}.bin", bytes([i]) * 6000)
    cache = tmpfs("1m")
    fill(cache, 60 << 10)
    with pytest.raises(OutputError, match=r"the volume holding .* is full"):
        s3sync.fetch_model(s3_bucket.uri("m/"), cache=cache)
    partial = next(cache.rglob(".*.partial"))
    assert (partial / s3sync.JOURNAL).exists() and not list(cache.rglob(f"{s3.PART}*"))
    free_up(cache)
    local = s3sync.fetch_model(s3_bucket.uri("m/"), cache=cache)
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == \
        [f"part-{i:02d}.bin" for i in range(30)]
    assert all(p.stat().st_size == 6000 for p in local.glob("part-*"))


def test_pack_on_a_full_disk(tmpfs, tiny_digits, monkeypatch):
    from kfvision.trainer.data import pack

    vol = tmpfs("2m")
    shutil.copytree(tiny_digits["val"], vol / "val")
    fill(vol, 4 << 10)
    with pytest.raises(OutputError, match="GiB is free there"):  # checked before writing
        pack.write_pack(vol / "val", progress=False)
    real = shutil.disk_usage
    # as if the check had passed: the disk then fills while the pixels are written
    monkeypatch.setattr(pack.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 40))
    with pytest.raises(OutputError, match=r"the volume holding .*kfvision-pack\.rgb is full"):
        pack.write_pack(vol / "val", progress=False)
    assert not (vol / "val" / pack.PIXELS).exists() and not (vol / "val" / pack.INDEX).exists()
    assert leftovers(vol / "val") == []
    assert read_image_directory(vol / "val", verify="hash").images
