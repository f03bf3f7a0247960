"""The pipeline deploy step's functions: the accuracy gate (the register step's too), and
serve-and-check on a real server."""

import csv
import json

import pytest

from kfvision.pipelines.flow.steps.common import accuracy_gate
from kfvision.pipelines.serve.selfcheck import (
    ServedLabelsDifferError,
    check_labels,
    serve_and_check,
)
from kfvision.trainer.errors import EvaluationError
from kfvision.trainer.use.score import score


@pytest.mark.parametrize("step", ["register", "deploy"])
@pytest.mark.parametrize("metrics, minimum, passes, words", [
    ({"accuracy": 0.95}, 0.9, True, "ing: accuracy 0.9500 >= {step}_min_accuracy 0.9000"),
    ({"accuracy": 0.9}, 0.9, True, "ing: accuracy 0.9000"),
    ({"accuracy": 0.5}, 0.9, False, "ed: accuracy 0.5000 is below {step}_min_accuracy 0.9000"),
    ({"accuracy": None}, 0.0, False, "ed: no evaluated accuracy"),  # unlabelled images
    ({"rows": 60}, 0.0, False, "ed: no evaluated accuracy"),
])
def test_one_accuracy_gate_for_register_and_deploy(step, metrics, minimum, passes, words,
                                                   tmp_path):
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    ok, accuracy, reason = accuracy_gate(tmp_path, minimum, step=step)
    assert ok is passes and accuracy == metrics.get("accuracy")
    assert words.format(step=step) in reason


@pytest.mark.parametrize("text", [None, "{not json", "[1, 2]"])
def test_an_unreadable_evaluation_is_an_evaluation_error(text, tmp_path):
    if text is not None:
        (tmp_path / "metrics.json").write_text(text)
    with pytest.raises(EvaluationError, match="metrics.json: the evaluation cannot be read"):
        accuracy_gate(tmp_path, 0.5, step="register")


@pytest.mark.slow
def test_serve_and_check_agrees_with_score_and_notices_a_difference(trained_tiny, tiny_digits,
                                                                    tmp_path):
    scored = tmp_path / "scored.csv"
    score(trained_tiny, tiny_digits["val"], scored, progress=False)
    figures = serve_and_check(trained_tiny, tiny_digits["val"], scored, tmp_path / "serve.log")
    n = figures["images"]
    assert n == 60 and figures["v1_labels_equal_scored"] == figures["v2_labels_equal_scored"] == n
    assert figures["v1_images_per_s"] > 0 and figures["v2_images_per_s"] > 0
    # a table that differs in one label: the labels served above (the table's) against it
    rows = list(csv.DictReader(scored.open()))
    served = [r["scored_label"] for r in rows]
    rows[0]["scored_label"] = "not a class"
    with pytest.raises(ServedLabelsDifferError, match="v2: 1 of 60 served labels differ from "
                       r"wrong.csv \(first: \['"):
        check_labels("v2", served, rows, "wrong.csv", tmp_path / "serve.log")
    with pytest.raises(ServedLabelsDifferError, match="v1: 0 of 60 served labels differ"):
        check_labels("v1", served[:-1], list(csv.DictReader(scored.open())), "s.csv", "log")
