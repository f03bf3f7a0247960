"""Evaluate Model: the scored table (`kfvision score`'s CSV) -> metrics, a report and a picture.

    kfvision evaluate --scored scored.csv --out eval/
      eval/metrics.json          every number below, machine-readable
      eval/report.md             the same, for people
      eval/confusion_matrix.png  the confusion matrix as a picture

Top-1 uses the table's `scored_label`. Top-5 uses the probability columns: an image counts when
fewer than 5 classes have a strictly higher probability than its true class (ties count in its
favour; with fewer than 5 classes, top-k is over all of them and is 1.0). Precision, recall and F1
are per class, with 0 where undefined (no predictions, or no images, of that class), as
scikit-learn's zero_division=0. Macro averages weigh classes equally; weighted ones by support.
The confusion matrix has the true classes as rows and the predicted ones as columns.
"""

import csv
from pathlib import Path

import numpy as np

from kfvision.trainer.errors import InvalidScoredTableError, NotLabeledDatasetError
from kfvision.trainer.fileio import atomic_write_bytes, atomic_write_json
from kfvision.trainer.use.plot import confusion_matrix_png

PROB_PREFIX = "scored_probability_"
TOP_K = 5


def read_scored(path) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """(classes, true indices, predicted indices, probabilities [n x classes]) of a scored CSV.

    Raises:
        InvalidScoredTableError: missing file or columns, a row with an unknown class or a
            non-numeric probability, or no rows. NotLabeledDatasetError: no `label` column.
    """
    path = Path(path)
    hint = "Give the CSV that `kfvision score` writes."
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise InvalidScoredTableError(f"{path} cannot be read ({type(e).__name__}: {e}). "
                                      + hint) from e
    if not rows:
        raise InvalidScoredTableError(f"{path} is empty. " + hint)
    header = rows[0]
    prob_cols = [i for i, h in enumerate(header) if h.startswith(PROB_PREFIX)]
    if "scored_label" not in header or not prob_cols:
        raise InvalidScoredTableError(
            f"{path} has no 'scored_label' and '{PROB_PREFIX}<class>' columns. " + hint)
    if "label" not in header:
        raise NotLabeledDatasetError(
            f"{path} has no 'label' column: it scores unlabelled images, and evaluation needs "
            "the true labels. Score a labelled image directory instead.")
    classes = [header[i][len(PROB_PREFIX):] for i in prob_cols]
    index = {c: k for k, c in enumerate(classes)}
    y_true, y_pred = header.index("label"), header.index("scored_label")
    n = len(rows) - 1
    if n == 0:
        raise InvalidScoredTableError(f"{path} has a header but no rows. " + hint)
    true, pred, probs = np.empty(n, int), np.empty(n, int), np.empty((n, len(classes)))
    for r, row in enumerate(rows[1:]):
        where = f"{path}, line {r + 2}"
        if len(row) != len(header):
            raise InvalidScoredTableError(f"{where}: {len(row)} fields, expected {len(header)}.")
        for col, out in ((y_true, true), (y_pred, pred)):
            if row[col] not in index:
                raise InvalidScoredTableError(
                    f"{where}: {header[col]} {row[col]!r} is not one of the classes of the "
                    f"probability columns ({', '.join(classes)}).")
            out[r] = index[row[col]]
        try:
            probs[r] = [float(row[i]) for i in prob_cols]
        except ValueError as e:
            raise InvalidScoredTableError(f"{where}: a probability is not a number ({e}).") from e
    return classes, true, pred, probs


def confusion_matrix(true: np.ndarray, pred: np.ndarray, n_classes: int) -> np.ndarray:
    """counts[i, j] = images of true class i predicted as class j."""
    cm = np.zeros((n_classes, n_classes), dtype=np.int64)
    np.add.at(cm, (true, pred), 1)
    return cm


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(a.shape, dtype=float), where=b != 0)


def compute_metrics(classes, true, pred, probs) -> dict:
    """Accuracy, top-5, per-class precision/recall/F1/support, averages and the matrix."""
    cm = confusion_matrix(true, pred, len(classes))
    tp = np.diag(cm).astype(float)
    support = cm.sum(axis=1)
    precision = _safe_div(tp, cm.sum(axis=0).astype(float))
    recall = _safe_div(tp, support.astype(float))
    f1 = _safe_div(2 * precision * recall, precision + recall)
    k = min(TOP_K, len(classes))
    p_true = probs[np.arange(len(true)), true]
    in_top_k = (probs > p_true[:, None]).sum(axis=1) < k
    per_class = [{"class": c, "precision": float(precision[i]), "recall": float(recall[i]),
                  "f1": float(f1[i]), "support": int(support[i])} for i, c in enumerate(classes)]
    weights = support / support.sum()
    return {
        "rows": int(len(true)),
        "classes": list(classes),
        "accuracy": float((true == pred).mean()),
        "top5_accuracy": float(in_top_k.mean()),
        "top_k": k,
        "per_class": per_class,
        "macro_avg": {"precision": float(precision.mean()), "recall": float(recall.mean()),
                      "f1": float(f1.mean()), "support": int(support.sum())},
        "weighted_avg": {"precision": float(precision @ weights),
                         "recall": float(recall @ weights), "f1": float(f1 @ weights),
                         "support": int(support.sum())},
        "confusion_matrix": cm.tolist(),
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_report(metrics: dict, source: str) -> str:
    """The metrics as a Markdown page (tables render in the KFP UI, GitHub and editors)."""
    m = dict(metrics, classes=[_cell(c) for c in metrics["classes"]])
    lines = [f"# Evaluation of `{source}`", "",
             f"- images: {m['rows']}", f"- classes: {len(m['classes'])}",
             f"- accuracy (top-1): **{m['accuracy']:.4f}**",
             f"- top-{m['top_k']} accuracy: **{m['top5_accuracy']:.4f}**", "",
             "## Per class", "", "| class | precision | recall | F1 | support |",
             "|---|---:|---:|---:|---:|"]
    for r in m["per_class"]:
        lines.append(f"| {_cell(r['class'])} | {r['precision']:.4f} | {r['recall']:.4f} | "
                     f"{r['f1']:.4f} | {r['support']} |")
    for name in ("macro_avg", "weighted_avg"):
        a = m[name]
        lines.append(f"| *{name.replace('_avg', ' average')}* | {a['precision']:.4f} | "
                     f"{a['recall']:.4f} | {a['f1']:.4f} | {a['support']} |")
    lines += ["", "## Confusion matrix", "",
              "Rows: true class; columns: predicted class.", "",
              "![confusion matrix](confusion_matrix.png)", ""]
    if len(m["classes"]) <= 30:  # wider tables are unreadable: the picture and JSON have them
        lines.append("| true \\ predicted | " + " | ".join(m["classes"]) + " |")
        lines.append("|---|" + "---:|" * len(m["classes"]))
        for c, row in zip(m["classes"], m["confusion_matrix"]):
            lines.append(f"| **{c}** | " + " | ".join(map(str, row)) + " |")
    return "\n".join(lines) + "\n"


def evaluate(scored_csv, out_dir) -> dict:
    """Compute the metrics of a scored table and write metrics.json, report.md and
    confusion_matrix.png into `out_dir` (created if needed). Returns the metrics.

    Every output is rendered before any is written, and each is written atomically.
    """
    classes, true, pred, probs = read_scored(scored_csv)
    metrics = compute_metrics(classes, true, pred, probs)
    report = markdown_report(metrics, Path(scored_csv).name)
    png = confusion_matrix_png(metrics["confusion_matrix"], classes,
                               f"Confusion matrix: {Path(scored_csv).name}, "
                               f"accuracy {metrics['accuracy']:.4f}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "metrics.json", metrics)
    atomic_write_bytes(out / "report.md", report.encode())
    atomic_write_bytes(out / "confusion_matrix.png", png)
    return metrics
