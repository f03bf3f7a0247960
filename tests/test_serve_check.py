"""The pipeline deploy step's functions: the accuracy gate, and serve-and-check on a real server."""

import csv

import pytest

from pipelines.serve.check import ServedLabelsDifferError, deploy_decision, serve_and_check
from trainer.use.score import score


@pytest.mark.parametrize("accuracy, minimum, deploy, words", [
    (0.95, 0.9, True, "deploying: accuracy 0.9500 >= deploy_min_accuracy 0.9000"),
    (0.9, 0.9, True, "deploying"),
    (0.5, 0.9, False, "below deploy_min_accuracy 0.9000"),
    (None, 0.0, False, "no evaluated accuracy"),
])
def test_deploy_decision(accuracy, minimum, deploy, words):
    got = deploy_decision(accuracy, minimum)
    assert got[0] is deploy and words in got[1]


def test_serve_and_check_agrees_with_score_and_notices_a_difference(trained_tiny, tiny_digits,
                                                                    tmp_path):
    scored = tmp_path / "scored.csv"
    score(trained_tiny, tiny_digits["val"], scored, progress=False)
    figures = serve_and_check(trained_tiny, tiny_digits["val"], scored, tmp_path / "serve.log")
    n = figures["images"]
    assert n == 60 and figures["v1_labels_equal_scored"] == figures["v2_labels_equal_scored"] == n
    assert figures["v1_images_per_s"] > 0 and figures["v2_images_per_s"] > 0
    rows = list(csv.DictReader(scored.open()))
    rows[0]["scored_label"] = "not a class"
    with (tmp_path / "wrong.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with pytest.raises(ServedLabelsDifferError, match="1 of 60 served labels differ"):
        serve_and_check(trained_tiny, tiny_digits["val"], tmp_path / "wrong.csv",
                        tmp_path / "serve2.log")
