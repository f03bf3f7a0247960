"""The training loop: schedule, early stopping, parameters, errors, accuracy, determinism."""

import json
import re
import sys

import pytest
import torch
from helpers.runs import train_argv

from kfvision.trainer.config import TrainConfig
from kfvision.trainer.data.imagedir import read_image_directory
from kfvision.trainer.engine import EarlyStopping, lr_factor
from kfvision.trainer.errors import InvalidParameterError
from kfvision.trainer.model.trained import load_trained_model
from kfvision.trainer.train import main

FAST = {"image_size": 32, "batch_size": 16, "lr": 0.05, "augment": "none", "print_freq": 100}


@pytest.mark.parametrize("step, warmup, total, power, expected", [
    (0, 0, 100, 1.0, 1.0),        # no warm-up: full lr at the start
    (50, 0, 100, 1.0, 0.5),       # linear decay half way
    (50, 0, 100, 2.0, 0.25),      # polynomial decay
    (99, 0, 100, 1.0, 0.01),
    (100, 0, 100, 1.0, 0.0),      # never negative past the end
    (0, 10, 110, 1.0, 0.1),       # warm-up starts at 1/warmup
    (9, 10, 110, 1.0, 1.0),       # and reaches the base lr
    (60, 10, 110, 1.0, 0.5),      # then decays over the remaining steps
])
def test_lr_schedule_warms_up_linearly_then_decays_polynomially(step, warmup, total, power,
                                                                expected):
    assert lr_factor(step, warmup, total, power) == pytest.approx(expected)


@pytest.mark.parametrize("losses, patience, stops_after, best", [
    ([3, 2, 1, 0.5], 3, None, 4),
    ([3, 2, 2.5, 2.6, 2.7, 1], 3, 5, 2),   # 3 epochs without a decrease
    ([3, 3, 3], 1, 2, 1),                   # equal is not a decrease
    ([1, 2, 0.5, 0.6, 0.7], 2, 5, 3),       # the counter resets on a new best
])
def test_early_stopping_counts_epochs_without_a_decrease(losses, patience, stops_after, best):
    es, stopped = EarlyStopping(patience), None
    for epoch, loss in enumerate(losses, 1):
        es.step(epoch, loss)
        if es.should_stop:
            stopped = epoch
            break
    assert stopped == stops_after and es.best_epoch == best


def test_defaults_are_the_azure_modules():
    cfg = TrainConfig("m", "t", "v", "o")
    assert (cfg.epochs, cfg.batch_size, cfg.warmup_epochs, cfg.lr, cfg.seed, cfg.patience,
            cfg.print_freq) == (5, 16, 0, 0.001, 1, 3, 10)


@pytest.mark.parametrize("field, value, message", [
    ("epochs", 0, "--epochs = 0 is out of range: it must be 1 <= --epochs <= 100000."),
    ("batch_size", 0, "1 <= --batch-size"),
    ("lr", 0.0, "0 < --lr <= 10"),
    ("lr", 11.0, "0 < --lr <= 10"),
    ("warmup_epochs", 9, "0 <= --warmup-epochs <= 5 (5: --epochs)."),
    ("patience", 0, "1 <= --patience"),
    ("momentum", 1.5, "--momentum <= 0.999"),
    ("image_size", 8, "32 <= --image-size"),
    ("augment", "heavy", "--augment = 'heavy' is not valid; choose one of: standard, strong, "
                         "light, none"),
    ("device", "tpu", "auto, cpu, cuda"),
])
def test_out_of_range_parameters_name_the_valid_range(field, value, message):
    with pytest.raises(InvalidParameterError) as e:
        TrainConfig("m", "t", "v", "o", **{field: value}).validate()
    assert message in str(e.value) and e.value.field == field


def test_yaml_config_is_read_and_flags_win(tmp_path, resnet18_dir, tiny_digits):
    from kfvision.trainer.config import config_from_args
    from kfvision.trainer.train import get_args_parser

    (tmp_path / "c.yaml").write_text("epochs: 7\nbatch-size: 8\nlr: 0.01\ncache: off\n"
                                     "dct-scaling: on\n")  # YAML 1.1 reads on/off as booleans
    args = get_args_parser().parse_args(
        train_argv(resnet18_dir, tiny_digits, tmp_path / "o", config=tmp_path / "c.yaml", lr=0.2))
    cfg = config_from_args(args)
    assert (cfg.epochs, cfg.batch_size, cfg.lr) == (7, 8, 0.2)
    assert (cfg.cache, cfg.dct_scaling) == ("off", "on")
    (tmp_path / "bad.yaml").write_text("epochz: 7\n")
    args.config = str(tmp_path / "bad.yaml")
    with pytest.raises(InvalidParameterError, match="unknown option.*epochz"):
        config_from_args(args)


def _metrics(out):
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.slow
def test_the_output_is_the_best_epochs_weights_with_history(tmp_path, resnet18_dir,
                                                            tiny_digits):
    out = tmp_path / "out"
    assert main(train_argv(resnet18_dir, tiny_digits, out, epochs=4, **FAST)) == 0
    m = _metrics(out)
    assert m["status"] == "completed" and m["epochs_run"] == len(m["history"]) == 4
    losses = [h["val_loss"] for h in m["history"]]
    assert m["best_epoch"] == 1 + losses.index(min(losses))
    for key in ("lr", "train_loss", "train_top1", "train_top5", "train_images_per_sec",
                "val_loss", "val_top1", "val_top5"):
        assert key in m["history"][0]
    # re-evaluate the written weights: they are the best epoch's, not the last epoch's
    from kfvision.trainer.use.score import score

    result = score(out, tiny_digits["val"], tmp_path / "s.csv", progress=False)
    assert result["accuracy"] == pytest.approx(m["final"]["val_top1"])
    cfg = (out / "config.yaml").read_text()
    assert "epochs: 4" in cfg and "world_size: 1" in cfg
    # the speed choices, and the CPU they were taken for
    from kfvision.trainer.fastpath import cpu_features

    assert m["fast_path"]["cpu"] == cpu_features().to_dict()
    assert m["fast_path"]["amp"] is False and m["fast_path"]["workers"] >= 0  # 32 px: fp32 anywhere


@pytest.mark.slow
def test_same_seed_gives_the_same_model_and_another_seed_does_not(tmp_path, resnet18_dir,
                                                                  tiny_digits, capsys):
    states = {}
    for name, seed, cache in (("a", 7, "auto"), ("b", 7, "auto"), ("c", 8, "off")):
        assert main(train_argv(resnet18_dir, tiny_digits, tmp_path / name, epochs=1, seed=seed,
                               cache=cache, **{**FAST, "augment": "light"})) == 0
        states[name] = torch.load(tmp_path / name / "weights.pt", weights_only=True)
        # decoding every epoch (here: --cache off) comes with the advice to pack
        assert ("kfvision pack" in capsys.readouterr().out) is (cache == "off")  # the log
    assert all(torch.equal(states["a"][k], states["b"][k]) for k in states["a"])
    assert not all(torch.equal(states["a"][k], states["c"][k]) for k in states["a"])


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_a_diverging_loss_stops_with_advice_and_keeps_the_history(tmp_path, resnet18_dir,
                                                                  tiny_digits, capsys, amp):
    """Diverges by construction, whatever the processor and precision: with lr x weight decay
    = 10, SGD's decay term alone multiplies every weight by about (1 - 10) each step (momentum
    only adds to it), so the weights grow ~9x a step whatever the gradients round to, and the
    batch norms' squared activations overflow float32 within the first epoch (step 11 of 15 in
    fp32). A large lr without weight decay is not enough: after batch norm the loss only grows
    polynomially and stays finite in fp32."""
    out = tmp_path / "out"
    rc = main(train_argv(resnet18_dir, tiny_digits, out, epochs=3, lr=10, momentum=0.99,
                         weight_decay=1, image_size=32, print_freq=1, augment="none", amp=amp))
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "became nan" in err.lower() or "became inf" in err.lower()
    assert "Lower --lr" in err and "Traceback" not in err


def test_train_and_val_categories_that_differ_fail_before_training(tmp_path, resnet18_dir,
                                                                   tiny_digits, capsys):
    import shutil

    from kfvision.trainer.data.imagedir import MANIFEST

    val = shutil.copytree(tiny_digits["val"], tmp_path / "val")
    doc = json.loads((val / MANIFEST).read_text())
    doc["classes"][-1] = "nine"
    (val / MANIFEST).write_text(json.dumps(doc))
    rc = main(train_argv(resnet18_dir, {"train": tiny_digits["train"], "val": val},
                         tmp_path / "out", **FAST))
    assert rc == 2
    assert "categories differ" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_training_on_the_digits_reaches_a_real_accuracy(digits_trained, digits):
    """The made-once digits run (helpers.runs.DIGITS_RUN, every other option at its default)."""
    final = digits_trained["final"]
    assert final["val_top1"] > 0.9, final
    model, info = load_trained_model(digits_trained["out"])
    assert info["classes"] == list(read_image_directory(digits["val"]).classes)


def test_the_log_shows_our_lines_once_and_leaves_the_callers_logging_alone(capsys):
    """`main` in a caller's process: the caller's root handlers and level stay; the trainer's and
    kfvision's INFO lines print once on stdout, with the time; another library's INFO does not
    (botocore's "Found credentials in environment variables" once printed in every S3 run); the
    caller's own handler still gets our lines. A process of another rank shows warnings only."""
    import io
    import logging

    from kfvision.trainer.train import setup_logging

    root = logging.getLogger()
    theirs = logging.StreamHandler(io.StringIO())
    before = (root.level, list(root.handlers))
    root.setLevel(logging.WARNING)  # Python's default: what a caller has unless it chose
    root.addHandler(theirs)
    try:
        setup_logging(True)
        setup_logging(True)  # a second run in the same process: still one line each
        assert root.handlers == [*before[1], theirs] and root.level == logging.WARNING
        logging.getLogger("trainer").info("a trainer line")
        logging.getLogger("kfvision.tune").info("a tune line")
        logging.getLogger("botocore.credentials").info("Found credentials")
        out = capsys.readouterr().out.splitlines()
        assert [line.split(" ", 1)[1] for line in out] == ["a trainer line", "a tune line"]
        assert re.fullmatch(r"\d\d:\d\d:\d\d", out[0].split(" ", 1)[0]), out
        assert theirs.stream.getvalue() == "a trainer line\na tune line\n"
        setup_logging(False)
        logging.getLogger("trainer").info("not on this rank")
        logging.getLogger("trainer").warning("a warning on every rank")
        assert capsys.readouterr().out.endswith(" a warning on every rank\n")
    finally:
        root.removeHandler(theirs)
        root.setLevel(before[0])
        setup_logging(True)


def test_the_log_follows_stdout_after_the_one_it_started_with_is_closed(monkeypatch, capsys):
    """`main` run in a caller's process (a notebook, `kfvision tune run`, these tests) configures
    the log; when that caller later closes the stdout it had, a log line still goes to the stdout
    there is then, and no "--- Logging error ---" lands on stderr."""
    import io
    import logging

    from kfvision.trainer.train import setup_logging

    first = io.StringIO()
    monkeypatch.setattr(sys, "stdout", first)
    setup_logging(True)
    first.close()
    monkeypatch.undo()
    logging.getLogger("trainer").info("a line after the first stdout closed")
    out, err = capsys.readouterr()
    assert "a line after the first stdout closed" in out and "Logging error" not in err
