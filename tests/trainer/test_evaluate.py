"""kfvision evaluate: the numbers (checked against a matrix worked out by hand), outputs, errors."""

import csv
import json
from fractions import Fraction as F

import numpy as np
import pytest
from PIL import Image

from kfvision.pipelines.cli import main
from kfvision.trainer.errors import InvalidScoredTableError, NotLabeledDatasetError
from kfvision.trainer.use.evaluate import evaluate

PROB = "scored_probability_"


def write_scored(path, classes, rows, label=True):
    """rows: (true class, predicted class, probabilities or None: 0.7 on the prediction)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image"] + (["label"] if label else []) + ["scored_label"]
                   + [PROB + c for c in classes])
        for i, (true, pred, probs) in enumerate(rows):
            if probs is None:
                rest = 0.3 / (len(classes) - 1)
                probs = [0.7 if c == pred else rest for c in classes]
            w.writerow([f"{true}/{i}.png"] + ([true] if label else []) + [pred] + probs)
    return path


# true -> predicted, 10 images; class d is predicted once but has no images
HAND_ROWS = ([("a", "a")] * 2 + [("a", "b")] + [("b", "b")] * 3 + [("b", "c")]
             + [("c", "a"), ("c", "c"), ("c", "d")])
HAND_MATRIX = [[2, 1, 0, 0],
               [0, 3, 1, 0],
               [1, 0, 1, 1],
               [0, 0, 0, 0]]
# worked out by hand from HAND_MATRIX: precision = diagonal / column sum, recall = diagonal / row
# sum, 0 where the sum is 0
HAND = {
    "precision": [F(2, 3), F(3, 4), F(1, 2), F(0)],
    "recall": [F(2, 3), F(3, 4), F(1, 3), F(0)],
    "f1": [F(2, 3), F(3, 4), F(2, 5), F(0)],
    "support": [3, 4, 3, 0],
    "macro": {"precision": F(23, 48), "recall": F(7, 16), "f1": F(109, 240)},
    "weighted": {"precision": F(65, 100), "recall": F(6, 10), "f1": F(62, 100)},
}


def test_metrics_match_a_confusion_matrix_worked_out_by_hand(tmp_path):
    scored = write_scored(tmp_path / "s.csv", "abcd", [(t, p, None) for t, p in HAND_ROWS])
    m = evaluate(scored, tmp_path / "eval")
    assert m["confusion_matrix"] == HAND_MATRIX
    assert m["rows"] == 10 and m["accuracy"] == pytest.approx(0.6)
    for i, row in enumerate(m["per_class"]):
        assert row["class"] == "abcd"[i] and row["support"] == HAND["support"][i]
        for k in ("precision", "recall", "f1"):
            assert row[k] == pytest.approx(float(HAND[k][i])), (row["class"], k)
    for avg in ("macro", "weighted"):
        for k, v in HAND[avg].items():
            assert m[f"{avg}_avg"][k] == pytest.approx(float(v)), (avg, k)
    assert m["top_k"] == 4 and m["top5_accuracy"] == 1.0  # 4 classes: top-4 holds everything
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text()) == m


def _ranked(true_rank: int) -> list:
    """Probabilities over 7 classes where the true class (the first) has the given rank."""
    probs = [0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05]
    return [probs[true_rank - 1]] + probs[:true_rank - 1] + probs[true_rank:]


TIED_5TH_AND_6TH = [0.1, 0.3, 0.2, 0.15, 0.12, 0.1, 0.03]  # 4 strictly higher: counts as top-5


def test_top5_counts_the_true_class_among_the_five_most_probable(tmp_path):
    classes = list("abcdefg")
    rows = [("a", "a", _ranked(1)), ("a", "b", _ranked(5)), ("a", "b", _ranked(6)),
            ("a", "b", _ranked(7)), ("a", "b", TIED_5TH_AND_6TH)]
    m = evaluate(write_scored(tmp_path / "s.csv", classes, rows), tmp_path / "e")
    assert m["top_k"] == 5
    assert m["top5_accuracy"] == pytest.approx(3 / 5)  # ranks 1, 5 and the tie are in
    assert m["accuracy"] == pytest.approx(1 / 5)


def test_metrics_agree_with_scikit_learn_on_a_random_table(tmp_path):
    from sklearn.metrics import (
        confusion_matrix,
        precision_recall_fscore_support,
        top_k_accuracy_score,
    )

    rng = np.random.default_rng(7)
    classes = [f"c{i}" for i in range(8)]
    true = rng.integers(0, 8, 300)
    probs = rng.dirichlet(np.ones(8) * 0.5, 300)
    probs[np.arange(300), true] += rng.random(300) * 0.5  # better than chance
    probs /= probs.sum(1, keepdims=True)
    pred = probs.argmax(1)
    rows = [(classes[t], classes[p], list(q)) for t, p, q in zip(true, pred, probs)]
    m = evaluate(write_scored(tmp_path / "s.csv", classes, rows), tmp_path / "e")
    assert m["confusion_matrix"] == confusion_matrix(true, pred, labels=range(8)).tolist()
    for avg in ("macro", "weighted"):
        p, r, f, _ = precision_recall_fscore_support(true, pred, labels=range(8), average=avg,
                                                     zero_division=0)
        assert [m[f"{avg}_avg"][k] for k in ("precision", "recall", "f1")] == pytest.approx(
            [p, r, f])
    assert m["top5_accuracy"] == pytest.approx(top_k_accuracy_score(true, probs, k=5,
                                                                    labels=range(8)))


def test_outputs_are_a_report_and_a_picture(tmp_path):
    scored = write_scored(tmp_path / "s.csv", "abcd", [(t, p, None) for t, p in HAND_ROWS])
    evaluate(scored, tmp_path / "eval")
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "accuracy (top-1): **0.6000**" in report
    assert "| c | 0.5000 | 0.3333 | 0.4000 | 3 |" in report
    assert "| **c** | 1 | 0 | 1 | 1 |" in report and "confusion_matrix.png" in report
    with Image.open(tmp_path / "eval" / "confusion_matrix.png") as im:
        assert im.format == "PNG" and im.width > 200 and im.height > 200
        # the diagonal cell of class b (3 of 4: 75 %) is darker than the empty cell beside it
        assert sum(_cell_colour(im, 1, 1)) < sum(_cell_colour(im, 1, 3))


def _cell_colour(im, row, col, n=4):
    """Colour at the centre of a matrix cell (the matrix is the bottom-right n x n block)."""
    rgb = np.asarray(im.convert("RGB"))
    white = (rgb == 255).all(axis=2)
    bottom = rgb.shape[0] - 1 - np.argmax(~white[::-1].all(axis=1))  # last non-white row
    right = rgb.shape[1] - 1 - np.argmax(~white[:, ::-1].all(axis=0))
    cell = max(14, min(64, 720 // n))
    y = bottom - (n - 1 - row) * cell - cell // 2
    x = right - (n - 1 - col) * cell - cell // 2
    return tuple(int(v) for v in rgb[y, x - cell // 3])  # beside the number, not on it


def test_scored_table_from_score_evaluates_to_the_same_accuracy(trained_tiny, tiny_digits,
                                                                 tmp_path):
    from kfvision.trainer.use.score import score

    result = score(trained_tiny, tiny_digits["val"], tmp_path / "s.csv", progress=False)
    m = evaluate(tmp_path / "s.csv", tmp_path / "e")
    assert m["accuracy"] == pytest.approx(result["accuracy"])
    assert m["rows"] == result["rows"] and m["top5_accuracy"] >= m["accuracy"]
    assert sum(map(sum, m["confusion_matrix"])) == result["rows"]


SCORED_ERRORS = {
    "unlabelled": (lambda p: write_scored(p, "ab", [("a", "a", None)], label=False),
                   NotLabeledDatasetError, "no 'label' column"),
    "unknown label": (lambda p: write_scored(p, "ab", [("z", "a", None)]),
                      InvalidScoredTableError, "line 2: label 'z' is not one of"),
    "not a number": (lambda p: write_scored(p, "ab", [("a", "a", ["x", 0.5])]),
                     InvalidScoredTableError, "line 2: a probability is not a number"),
    "no rows": (lambda p: write_scored(p, "ab", []), InvalidScoredTableError, "no rows"),
    "empty file": (lambda p: p.write_text(""), InvalidScoredTableError, "is empty"),
    "other CSV": (lambda p: p.write_text("a,b\n1,2\n"), InvalidScoredTableError,
                  "no 'scored_label'"),
    "missing file": (lambda p: None, InvalidScoredTableError, "cannot be read"),
    "short row": (lambda p: p.write_text(f"image,label,scored_label,{PROB}a,{PROB}b\nx,a,a,1\n"),
                  InvalidScoredTableError, "line 2: 4 fields, expected 5"),
}


@pytest.mark.parametrize("case", list(SCORED_ERRORS))
def test_bad_scored_tables_are_named_errors_and_write_nothing(tmp_path, case):
    make, error, match = SCORED_ERRORS[case]
    make(tmp_path / "s.csv")
    with pytest.raises(error, match=match):
        evaluate(tmp_path / "s.csv", tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


def test_cli_evaluate(tmp_path, capsys):
    scored = write_scored(tmp_path / "s.csv", "abcd", [(t, p, None) for t, p in HAND_ROWS])
    assert main(["evaluate", "--scored", str(scored), "--out", str(tmp_path / "e")]) == 0
    out = capsys.readouterr().out
    assert "evaluated 10 images: accuracy 0.6000, top-4 1.0000, macro F1 0.4542" in out
    assert {p.name for p in (tmp_path / "e").iterdir()} == {"metrics.json", "report.md",
                                                            "confusion_matrix.png"}
    assert main(["evaluate", "--scored", str(tmp_path / "nope.csv"), "--out", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_cli_evaluate_logs_into_the_run_of_mlflow_run_id(mlflow_server, tmp_path, capsys,
                                                         monkeypatch):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.create_experiment(f"evaluate-{tmp_path.name}")
    given = client.create_run(exp).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_RUN_ID", given)
    scored = write_scored(tmp_path / "s.csv", "abcd", [(t, p, None) for t, p in HAND_ROWS])
    assert main(["evaluate", "--scored", str(scored), "--out", str(tmp_path / "e")]) == 0
    assert f"logged the evaluation into MLflow run {given}" in capsys.readouterr().out
    run = client.get_run(given)
    assert run.data.metrics["eval_accuracy"] == pytest.approx(0.6)
    assert run.data.metrics["eval_macro_f1"] == pytest.approx(0.4542, abs=1e-4)
    assert "eval_per_class" not in run.data.metrics and "eval_top_k" in run.data.metrics
    assert {a.path for a in client.list_artifacts(given, "evaluation")} == {
        "evaluation/report.md", "evaluation/metrics.json", "evaluation/confusion_matrix.png"}
    assert run.info.status == "RUNNING"  # the run is KFP's (or the trainer's): not closed here


def test_cli_evaluate_with_the_server_down_is_one_named_line(tmp_path, capsys, caplog,
                                                             monkeypatch):
    from kfvision.pipelines.clients.endpoints import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    scored = write_scored(tmp_path / "s.csv", "abcd", [(t, p, None) for t, p in HAND_ROWS])
    assert main(["evaluate", "--scored", str(scored), "--out", str(tmp_path / "e"),
                 "--tracking-uri", f"http://127.0.0.1:{free_port()}"]) == 0
    captured = capsys.readouterr()
    # the warning goes through logging: one record, printed at most once (where it is printed
    # depends on the process's logging: an in-process training before this test configures it)
    warned = [r.getMessage() for r in caplog.records if "MLflowTrackingError" in r.getMessage()]
    printed = captured.out + captured.err
    assert len(warned) == 1 and "unreachable" in warned[0], warned
    assert printed.count("MLflowTrackingError") <= 1, printed
    assert "logged the evaluation" not in printed + caplog.text
    assert (tmp_path / "e" / "report.md").is_file()
