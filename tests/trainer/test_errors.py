"""Errors are named for what failed: every `raise InvalidModelDirectoryError(...)` in pipelines/
and trainer/ concerns a model directory (its message says so), so whoever searches a log for it
looks in the right place; storage, parameter and evaluation problems have their own errors."""

import ast
import io
import re
import tokenize

import pytest
from helpers.paths import REPO

from kfvision.trainer.errors import (
    EvaluationError,
    InvalidModelDirectoryError,
    InvalidParameterError,
    KfvisionError,
    StorageError,
)
from kfvision.trainer.exitcodes import EXIT_INPUT

# What a message about a model directory mentions: the folder itself (in words, or formatted from
# a variable `model_dir`), one of its files (spec.json, model.json, metrics.json, weights.pt), the
# class names a script's model directory lists, or the weights a new model directory is made from.
MODEL_DIRECTORY_WORDS = ("model directory", "model_dir", "model.json", "spec", "weights",
                         "state_dict", "class names", "SPEC_FILE", "MODEL_FILE", "WEIGHTS_FILE")


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
    from kfvision.trainer.model.arch import write_untrained_model

    with pytest.raises(InvalidParameterError, match="not both"):
        write_untrained_model(tmp_path / "m", "resnet18", pretrained=True, weights="w.pt")


# --- comments and docs say why, not where a reason was once discussed ---------------------------
# A reader of the repository cannot open our tracker's numbers, nor knows what one of our working
# sessions was: comments, docstrings and the docs write the reason itself. An upstream reference
# (`pytorch/vision#8436`) can be opened, and a technical session (a process's, an HTTP client's,
# `AWS_SESSION_TOKEN`, pytest's) is not ours. A date says nothing of why in a comment; in the docs
# it says when a figure was measured, and stays.
TRACKER = r"\bissues?\s*#?\d+|\bthe\s+issue('s)?\b|(?<![\w.-])#\d+\b"
OUR_SESSION = (r"\b(?:this|another|other|previous|earlier|last|next|former|later)[-\s]+sessions?\b"
               r"|\bsame-session\b|\bsessions?\s+before\b")
DATE = r"\b20\d\d-\d\d-\d\d\b"
CITATION = re.compile(f"{TRACKER}|{OUR_SESSION}|{DATE}", re.IGNORECASE)
DOCS_CITATION = re.compile(f"{TRACKER}|{OUR_SESSION}", re.IGNORECASE)
PROSE_FOLDERS = ("pipelines", "trainer", "tests", "bench", "tools")


def prose(path):
    """(line, text) of every comment and docstring in a Python file."""
    text = path.read_text(encoding="utf-8")
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string.lstrip("#")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "lineno", 1), doc


def test_no_comment_or_docstring_cites_an_issue_or_a_date():
    found = [f"{path.relative_to(REPO)}:{line}: {CITATION.search(text).group()}"
             for folder in PROSE_FOLDERS for path in sorted((REPO / folder).rglob("*.py"))
             for line, text in prose(path) if CITATION.search(text)]
    assert found == []


def test_no_page_of_the_docs_cites_our_tracker_or_our_sessions():
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        found += [f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
                  for m in DOCS_CITATION.finditer(text)]
    assert found == []


# (text, refused in a comment, refused in the docs)
PHRASES = [
    ("a resumed run drifted (issue 26)", True, True),
    ("(issue 25: the draft's names)", True, True),
    ("see #12", True, True),
    ("the issue's bar", True, True),
    ("The issue's\nMilan figures", True, True),
    ("measured in this session", True, True),
    ("439 s (506 the session before)", True, True),
    ("and, in another session, one H200", True, True),
    ("shared with five other sessions' work", True, True),
    ("the previous session's CI-like run", True, True),
    ("only same-session figures are compared", True, True),
    ("the table above is an earlier session's", True, True),
    ("quarantined on 2026-11-24", True, False),
    ("Measured 2026-11-26 on one NVIDIA H200", True, False),
    ("the issuer of the certificate", False, False),
    ("colour #1f77b4", False, False),
    ("torchvision once imported it lazily, pytorch/vision#8436", False, False),
    ("measured there (NVIDIA/cudnn-frontend#1066)", False, False),
    ("openvinotoolkit/openvino pull request 36980", False, False),
    ("AWS_SESSION_TOKEN", False, False),
    ("signed with and without a session token", False, False),
    ("each replica runs in a session of its own", False, False),
    ("torchrun puts its training processes in new sessions", False, False),
    ("the terminal or SSH session closed", False, False),
    ("a session's leader", False, False),
    ("sent through the client's own HTTP session", False, False),
    ("botocore's own calls go through the same session", False, False),
    ("one server a pytest session", False, False),
    ("DDP buckets differ on the first step", False, False),
]


@pytest.mark.parametrize("text, in_code, in_docs", PHRASES)
def test_the_citation_patterns(text, in_code, in_docs):
    assert bool(CITATION.search(text)) is in_code
    assert bool(DOCS_CITATION.search(text)) is in_docs
