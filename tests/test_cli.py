"""Smoke tests of the `kfvision` command line, run as a user would (a new process each)."""

import csv
import subprocess
import sys

import pytest
from conftest import REPO


def kfvision(*args, check=True):
    run = subprocess.run([sys.executable, "-m", "pipelines.cli", *map(str, args)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    if check:
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run


@pytest.mark.parametrize("command", [[], ["convert"], ["model", "resnet"], ["model", "densenet"],
                                     ["train"], ["score"], ["demo"]])
def test_help_explains_every_command(command):
    run = kfvision(*command, "--help")
    assert "usage: kfvision" in run.stdout


def test_train_help_shows_the_defaults():
    out = kfvision("train", "--help").stdout
    for text in ("--epochs", "(default: 5)", "--batch-size", "(default: 16)", "--lr",
                 "(default: 0.001)", "--patience", "(default: 3)", "--nproc-per-node"):
        assert text in out


def test_convert_model_train_score_end_to_end(tmp_path, tiny_digits):
    raw = tiny_digits["raw"]
    run = kfvision("convert", raw / "train", tmp_path / "train")
    assert "wrote 240 images" in run.stdout
    kfvision("convert", raw / "val", tmp_path / "val")
    run = kfvision("model", "resnet", tmp_path / "model", "--name", "resnet18")
    assert "random initialisation" in run.stdout
    run = kfvision("train", "--model", tmp_path / "model", "--train", tmp_path / "train",
                   "--val", tmp_path / "val", "--out", tmp_path / "trained", "--epochs", 1,
                   "--image-size", 32, "--lr", 0.05, "--print-freq", 5)
    assert "epoch 1 [ 5/15]" in run.stdout and "done: best epoch 1 of 1" in run.stdout
    run = kfvision("score", "--model", tmp_path / "trained", "--data", tmp_path / "val",
                   "--out", tmp_path / "scored.csv", "--quiet")
    assert "scored 60 images" in run.stdout
    assert len(list(csv.reader((tmp_path / "scored.csv").open()))) == 61


@pytest.mark.parametrize("args, name, message", [
    (["convert", "/nonexistent/src", "/tmp/x"], "InvalidDatasetError", "does not exist"),
    (["train", "--model", "/nonexistent", "--train", "t", "--val", "v", "--out", "o"],
     "InvalidModelDirectoryError", "not a model directory"),
    (["train", "--model", "m", "--train", "t", "--val", "v", "--out", "o", "--epochs", "0"],
     "InvalidParameterError", "1 <= --epochs"),
    (["score", "--model", "/nonexistent", "--data", "d", "--out", "o.csv"],
     "InvalidModelDirectoryError", "not a trained model directory"),
])
def test_errors_are_one_named_message_and_a_nonzero_exit_without_a_traceback(args, name, message):
    run = kfvision(*args, check=False)
    assert run.returncode == 2
    assert run.stderr.startswith(f"error: {name}: ") and message in run.stderr
    assert "Traceback" not in run.stderr


def test_a_bad_model_name_lists_the_choices():
    run = kfvision("model", "densenet", "/tmp/x", "--name", "densenet999", check=False)
    assert run.returncode == 2 and "densenet121" in run.stderr and "densenet201" in run.stderr


@pytest.mark.parametrize("command, heavy", [
    ([], []), (["convert"], []), (["train"], []), (["job"], []), (["pipeline"], ["kfp"]),
    (["model"], [])])
def test_the_command_line_loads_torch_and_kfp_only_for_the_commands_that_need_them(command,
                                                                                    heavy):
    # building the parser for `kfvision --help` with all of them took 8 s on the 2-core machine
    code = ("import sys; from pipelines.cli import build_parser; build_parser(sys.argv[1:]); "
            "print(sorted(m for m in ('kfp', 'torch') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code, *command], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(heavy)


def test_training_on_an_unlabelled_directory_names_the_error(tiny_digits, resnet18_dir, tmp_path):
    from trainer.data.convert import convert

    loose = tmp_path / "loose"
    loose.mkdir()
    for f in sorted((tiny_digits["raw"] / "val" / "3").iterdir())[:4]:
        (loose / f.name).write_bytes(f.read_bytes())
    convert(loose, tmp_path / "unlabelled", progress=False)
    run = kfvision("train", "--model", resnet18_dir, "--train", tmp_path / "unlabelled", "--val",
                   tiny_digits["val"], "--out", tmp_path / "out", check=False)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "error: NotLabeledDatasetError: " in run.stderr
