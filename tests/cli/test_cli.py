"""Smoke tests of the `kfvision` command line, run as a user would (a new process each)."""

import argparse
import csv
import subprocess
import sys

import pytest
from helpers.parsers import command_parser, every_parser, minimal_argv, parse
from helpers.paths import REPO


def kfvision(*args, check=True):
    run = subprocess.run([sys.executable, "-m", "kfvision.pipelines.cli", *map(str, args)],
                         cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    if check:
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run


@pytest.mark.parametrize("command", [[], ["convert"], ["model"],
                                     ["train"], ["score"], ["demo"]])
def test_help_explains_every_command(command):
    run = kfvision(*command, "--help")
    assert "usage: kfvision" in run.stdout


@pytest.mark.parametrize("named", [None, "train", "job", "pipeline", "serve", "deploy", "tune",
                                   "register"])
def test_every_commands_one_line_help_is_helps_in_its_order(named):
    """pipelines/cli/__init__.py's HELP is the one place of each command's line in `kfvision
    --help`, whether its flags were built (the command named) or not; a group's line ends with
    its verbs as its parser has them (VERBS, which `make docs` writes from the parsers)."""
    from kfvision.pipelines.cli import HELP, LAZY, help_line

    assert set(LAZY) <= set(HELP)
    top = command_parser(named)
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    assert [(c.dest, c.help) for c in commands._choices_actions] == [
        (name, help_line(name)) for name in HELP]
    if named in ("job", "pipeline", "deploy", "tune"):
        group = commands.choices[named]
        verbs = next(a for a in group._actions if isinstance(a, argparse._SubParsersAction))
        assert help_line(named).endswith(": " + ", ".join(verbs.choices))


def test_train_help_shows_the_defaults():
    out = kfvision("train", "--help").stdout
    for text in ("--epochs", "(default: 5)", "--batch-size", "(default: 16)", "--lr",
                 "(default: 0.001)", "--patience", "(default: 3)", "--nproc-per-node"):
        assert text in out


@pytest.mark.slow
def test_convert_model_train_score_end_to_end(tmp_path, tiny_digits):
    raw = tiny_digits["raw"]
    run = kfvision("convert", raw / "train", tmp_path / "train")
    assert "wrote 240 images" in run.stdout
    kfvision("convert", raw / "val", tmp_path / "val")
    run = kfvision("model", "resnet18", tmp_path / "model")
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


@pytest.mark.parametrize("args", [["densenet999", "/tmp/x"],
                                  ["densenet", "/tmp/x", "--name", "densenet999"]])
def test_a_bad_model_name_lists_the_closest_choices(args):
    run = kfvision("model", *args, check=False)
    assert run.returncode == 2 and "densenet121" in run.stderr and "densenet201" in run.stderr


@pytest.mark.parametrize("command, heavy", [
    ([], []), (["convert"], []), (["train"], []), (["job"], []), (["pipeline"], ["kfp"]),
    (["model"], [])])
@pytest.mark.process
def test_the_command_line_loads_torch_and_kfp_only_for_the_commands_that_need_them(command,
                                                                                    heavy):
    # building the parser for `kfvision --help` with all of them took 8 s on the 2-core machine
    code = ("import sys; from kfvision.pipelines.cli import build_parser; "
            "build_parser(sys.argv[1:]); "
            "print(sorted(m for m in ('kfp', 'torch') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code, *command], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(heavy)


@pytest.mark.parametrize("args", [
    ["--epochs", "0"],
    [],  # the model directory does not exist
    ["--nproc-per-node", "2"],  # nor is torchrun started, whose processes would say the same
])
def test_train_says_a_wrong_flag_or_input_before_it_imports_torch(tmp_path, args):
    argv = ["train", "--model", str(tmp_path / "none"), "--train", "t", "--val", "v", "--out",
            str(tmp_path / "out"), *args]
    run = _main_without_torch(argv)
    assert run.stdout.split() == ["2", "False"], run.stdout + run.stderr
    assert run.stderr.startswith("error: Invalid") and "[kfvision launch]" not in run.stderr


def _main_without_torch(argv) -> subprocess.CompletedProcess:
    """`kfvision ARGV` in a fresh process, which prints its exit code and whether it imported
    torch."""
    code = ("import sys; from kfvision.pipelines.cli import main; rc = main(sys.argv[1:]); "
            "print(rc, 'torch' in sys.modules)")
    return subprocess.run([sys.executable, "-c", code, *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", [["score", "--data", "d", "--out", "s.csv"],
                                     ["export", "--out", "m.onnx"], ["serve"]])
@pytest.mark.parametrize("model, says", [
    ("none", "it does not exist"),
    ("half", "needs model.json and weights.pt"),
    ("untrained", "not a trained model directory but an untrained one")])
def test_score_export_and_serve_say_a_wrong_model_before_they_import_torch(
        tmp_path, resnet18_dir, command, model, says):
    where = {"none": tmp_path / "none", "half": tmp_path / "half", "untrained": resnet18_dir}
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model.json").write_text("{}")
    run = _main_without_torch([command[0], "--model", where[model], *command[1:]])
    assert run.stdout.split() == ["2", "False"], run.stdout + run.stderr
    assert run.stderr.startswith("error: InvalidModelDirectoryError: ") and says in run.stderr


def test_score_says_a_wrong_image_directory_before_it_imports_torch(tmp_path, trained_tiny):
    run = _main_without_torch(["score", "--model", trained_tiny, "--data", tmp_path / "none",
                               "--out", tmp_path / "s.csv"])
    assert run.stdout.split() == ["2", "False"], run.stdout + run.stderr
    assert run.stderr.startswith("error: InvalidDatasetError: ") and "not a folder" in run.stderr


def test_convert_and_the_pipelines_convert_step_never_import_torch(tmp_path, tiny_digits):
    """Each image is checked with Pillow alone (trainer/data/rgb.py): a conversion starts 2 s
    sooner, and so does every pipeline run's convert step."""
    code = ("import sys; from kfvision.pipelines.cli import main; "
            "from kfvision.pipelines.flow.steps.common import run; "
            "from kfvision.pipelines.flow.steps.data import convert_step; "
            "rc = main(['convert', sys.argv[1], sys.argv[2] + '/cli', '--quiet']); "
            "run(convert_step, sys.argv[1], sys.argv[2] + '/step', labels='', place=None); "
            "print(rc, 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code, str(tiny_digits["raw"] / "val"),
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.stdout.split()[-2:] == ["0", "False"], run.stdout + run.stderr
    assert "wrote 60 images" in run.stdout


def test_training_on_an_unlabelled_directory_names_the_error(tiny_digits, resnet18_dir, tmp_path):
    from kfvision.trainer.data.convert import convert

    loose = tmp_path / "loose"
    loose.mkdir()
    for f in sorted((tiny_digits["raw"] / "val" / "3").iterdir())[:4]:
        (loose / f.name).write_bytes(f.read_bytes())
    convert(loose, tmp_path / "unlabelled", progress=False)
    run = kfvision("train", "--model", resnet18_dir, "--train", tmp_path / "unlabelled", "--val",
                   tiny_digits["val"], "--out", tmp_path / "out", check=False)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "error: NotLabeledDatasetError: " in run.stderr


def _abbreviations(parser) -> list:
    """(option string, its longest prefix that names it alone) of each long option of `parser`:
    what argparse would silently expand by default. Options every prefix of which names another
    option too (`--deploy`, `--deploy-name`) have none."""
    strings = [s for s in parser._option_string_actions if s.startswith("--")]
    out = []
    for s in strings:
        prefix = next((s[:n] for n in range(len(s) - 1, 2, -1)
                       if sum(o.startswith(s[:n]) for o in strings) == 1), None)
        if prefix:
            out.append((s, prefix))
    return out


PARSERS = every_parser()


@pytest.mark.parametrize("words, parser", PARSERS,
                         ids=["python -m kfvision.trainer.train" if w is None
                              else " ".join(("kfvision", *w)) for w, _ in PARSERS])
def test_no_parser_expands_an_abbreviation(words, parser):
    """Each long option, cut short to a prefix only it has, is refused by name, not expanded;
    written out whole it is understood (whatever its value would need)."""
    assert parser.allow_abbrev is False
    head = [] if words is None else list(words)
    rest = minimal_argv(parser)
    target = parser if words is None else None
    assert parse([*head, *rest], target) == (None, ""), "the minimal command line must parse"
    checked = 0
    for option, prefix in _abbreviations(parser):
        code, err = parse([*head, prefix, *rest], target)
        assert code == 2 and f"unrecognized arguments: {prefix}" in err, (option, err)
        assert len(err.strip().splitlines()) == 1, err  # one line, no usage
        code, err = parse([*head, option, *rest], target)
        assert "unrecognized arguments" not in err, (option, err)
        checked += 1
    assert checked or words is not None and not _abbreviations(parser)


@pytest.mark.parametrize("argv", [
    ["train", "--nproc", "2", "--model", "m", "--train", "t", "--val", "v", "--out", "o"],
    ["train", "--nproc-per", "2", "--model", "m", "--train", "t", "--val", "v", "--out", "o"],
    ["tune", "run", "--nproc", "2", "--model", "m", "--train", "t", "--val", "v", "--out", "o"],
])
def test_train_refuses_a_shortened_nproc_per_node_in_one_line(argv):
    run = kfvision(*argv, check=False)
    command = " ".join(argv[:2] if argv[0] == "tune" else argv[:1])
    flag = next(a for a in argv if a.startswith("--nproc"))
    # tune run also takes a script's arguments (docs/scripts.md): the 2 is taken as one of them
    unknown = flag if argv[0] == "tune" else f"{flag} 2"
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == (f"kfvision {command}: error: unrecognized arguments: {unknown} "
                          f"(see kfvision {command} --help)\n")


def test_the_trainer_gets_its_flags_from_the_parsed_options(monkeypatch, tmp_path,
                                                            micro_digits, resnet18_dir):
    """What `kfvision train` hands the trainer is written from the configuration its parser
    built (a --config file merged in), never a filtered copy of the command line."""
    from kfvision.pipelines.cli import main
    from kfvision.trainer import train

    got = []
    monkeypatch.setattr(train, "main", lambda argv: got.append(argv) or 0)
    (tmp_path / "c.yaml").write_text("lr: 0.05\nepochs: 7\n")
    paths = ["--model", str(resnet18_dir), "--train", str(micro_digits["train"]), "--val",
             str(micro_digits["val"]), "--out", "o"]
    assert main(["train", *paths, f"--config={tmp_path / 'c.yaml'}", "--nproc-per-node", "1",
                 "--epochs=2", "--print-freq", "5"]) == 0
    assert got == [[*paths, "--epochs", "2", "--lr", "0.05", "--print-freq", "5"]]
