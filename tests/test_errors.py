"""Errors are named for what failed: every `raise InvalidModelDirectoryError(...)` in pipelines/
and trainer/ concerns a model directory (its message says so), so whoever searches a log for it
looks in the right place; storage, parameter and evaluation problems have their own errors."""

import ast

import pytest
from conftest import REPO

from trainer.errors import (
    EvaluationError,
    InvalidModelDirectoryError,
    InvalidParameterError,
    KfvisionError,
    StorageError,
)
from trainer.exitcodes import EXIT_INPUT

# What a message about a model directory mentions: the folder itself, one of its files (spec.json,
# model.json, metrics.json, weights.pt), or the weights a new model directory is made from.
MODEL_DIRECTORY_WORDS = ("model directory", "model.json", "spec", "weights", "state_dict",
                         "SPEC_FILE", "MODEL_FILE", "WEIGHTS_FILE")


def _text(node) -> str:
    """The literal text of a message expression: its string constants and the names it
    formats, joined (a variable such as `hint` counts by its name)."""
    parts = []
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            parts.append(n.value)
        elif isinstance(n, ast.Name):
            parts.append(n.id)
    return " ".join(parts)


def model_directory_raises():
    """(file:line, message text) of every `raise InvalidModelDirectoryError(...)`."""
    for package in ("pipelines", "trainer"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                        and isinstance(node.exc.func, ast.Name)
                        and node.exc.func.id == InvalidModelDirectoryError.__name__):
                    where = f"{path.relative_to(REPO)}:{node.lineno}"
                    yield where, " ".join(_text(a) for a in node.exc.args)


def test_every_model_directory_error_concerns_a_model_directory():
    found = list(model_directory_raises())
    assert len(found) >= 10  # the walk sees them (arch.py, trained.py, registry.py, ...)
    stray = [where for where, text in found
             if not any(w.lower() in text.lower() for w in MODEL_DIRECTORY_WORDS)]
    assert stray == []


def test_the_checker_catches_a_storage_problem_raised_as_a_model_directory_error():
    tree = ast.parse('raise InvalidModelDirectoryError(f"{DATA_MOUNT} is not mounted")')
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.Raise)]
    assert not any(w.lower() in _text(node.exc).lower() for w in MODEL_DIRECTORY_WORDS)


@pytest.mark.parametrize("error", [StorageError, EvaluationError])
def test_storage_and_evaluation_errors_are_their_own_and_keep_exit_code_2(error):
    assert issubclass(error, KfvisionError) and not issubclass(error, InvalidModelDirectoryError)
    assert error("x").exit_code == EXIT_INPUT == InvalidModelDirectoryError("x").exit_code


def test_giving_pretrained_and_weights_is_a_parameter_error(tmp_path):
    from trainer.model.arch import write_untrained_model

    with pytest.raises(InvalidParameterError, match="not both"):
        write_untrained_model(tmp_path / "m", "resnet18", pretrained=True, weights="w.pt")
