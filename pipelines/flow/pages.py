"""Pages for the KFP UI: training curves (HTML with inline SVG charts) and the evaluation page.

The KFP UI shows an `HTML` artifact in a sandboxed frame that loads nothing from outside, so
everything is inline: the charts are SVG drawn here (no plotting library), pictures are data URIs.
"""

import base64
import html
import math
import shlex

WIDTH, HEIGHT, PAD = 420, 260, 44
COLOURS = {"train": "#1f77b4", "val": "#d62728"}


def _scale(values, lo, hi, size, flip=False):
    span = (hi - lo) or 1.0
    out = [(v - lo) / span * size for v in values]
    return [size - v for v in out] if flip else out


def _tick(value: float, log: bool) -> float:
    return 10 ** value if log else value


def line_chart(title: str, epochs: list, series: dict, y_range=None, log: bool = False) -> str:
    """An SVG line chart: `series` maps a name ('train', 'val') to one value per epoch. `log`: a
    logarithmic y axis (when every value is positive and finite), so that a first epoch's loss
    tens of times the later ones does not flatten them all into one line at the bottom."""
    values = [v for vs in series.values() for v in vs]
    log = log and all(math.isfinite(v) and v > 0 for v in values)
    if log:
        series = {name: [math.log10(v) for v in vs] for name, vs in series.items()}
        values = [v for vs in series.values() for v in vs]
        title = f"{title} (log scale)"
    lo, hi = y_range or (min(values), max(values))
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    w, h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD
    xs = [PAD + x for x in _scale(epochs, min(epochs), max(epochs), w)] if len(epochs) > 1 else [
        PAD + w / 2]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'role="img" aria-label="{html.escape(title)}">',
             f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="14">'
             f'{html.escape(title)}</text>',
             f'<rect x="{PAD}" y="{PAD}" width="{w}" height="{h}" fill="none" stroke="#999"/>']
    for frac in (0.0, 0.5, 1.0):  # y ticks: bottom, middle, top
        y = PAD + h - frac * h
        parts.append(f'<text x="{PAD - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10">'
                     f'{_tick(lo + frac * (hi - lo), log):.3g}</text>')
    for e, x in zip(epochs, xs):
        parts.append(f'<text x="{x:.1f}" y="{PAD + h + 14}" text-anchor="middle" '
                     f'font-size="10">{e}</text>')
    parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT - 6}" text-anchor="middle" '
                 'font-size="11">epoch</text>')
    for i, (name, vs) in enumerate(series.items()):
        ys = [PAD + y for y in _scale(vs, lo, hi, h, flip=True)]
        colour = COLOURS.get(name, "#2ca02c")
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys))
        parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" '
                     'stroke-width="2"/>')
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{colour}"/>'
                  for x, y in zip(xs, ys)]
        parts.append(f'<text x="{PAD + w - 4}" y="{PAD + 14 + 14 * i}" text-anchor="end" '
                     f'font-size="11" fill="{colour}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def train_metrics(summary: dict) -> dict:
    """{name: number} the train step logs for the KFP UI: the built-in trainer's final figures,
    best epoch and epochs run; for a user's script, the numbers of its metrics.json "final"."""
    final = summary["final"]
    if "script" in summary:
        return {k: round(float(v), 6) for k, v in final.items()}
    figures = {k: round(float(final[k]), 6) for k in ("val_top1", "val_top5", "val_loss",
                                                      "train_images_per_sec")}
    return {**figures, "best_epoch": summary["best_epoch"], "epochs_run": summary["epochs_run"]}


def script_html(summary: dict, title: str = "Trained by your script") -> str:
    """The train step's page for a user's script: what ran, its final figures, the layout."""
    s = summary["script"]
    rows = [("script", f"{s['entry']} {shlex.join(s['args'])}".strip()),
            ("launcher", s["launcher"]), ("source sha256", s["source_sha256"]),
            ("model folder", "scored, registered and deployed as it is" if summary["layout"] ==
             "ok" else f"cannot be scored: {summary['layout']}"),
            *((k, f"{v:.6g}") for k, v in summary["final"].items())]
    table = "".join(f"<tr><th align='left'>{html.escape(k)}</th><td>{html.escape(str(v))}</td>"
                    "</tr>" for k, v in rows)
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>"
            f"{html.escape(title)}</title></head><body style='font-family:sans-serif'>"
            f"<h3>{html.escape(title)}</h3><table>{table}</table></body></html>\n")


def curves_html(metrics: dict, title: str = "Training curves") -> str:
    """An HTML page with loss, top-1 and learning-rate charts of a trained model's history (a
    user's script's summary: its script_html page)."""
    if "script" in metrics:
        return script_html(metrics)
    history = metrics["history"]
    epochs = [h["epoch"] for h in history]
    final, best = metrics.get("final", {}), metrics.get("best_epoch")
    charts = [
        line_chart("loss", epochs, {"train": [h["train_loss"] for h in history],
                                    "val": [h["val_loss"] for h in history]}, log=True),
        line_chart("top-1 accuracy", epochs, {"train": [h["train_top1"] for h in history],
                                              "val": [h["val_top1"] for h in history]},
                   y_range=(0.0, 1.0)),
        line_chart("learning rate", epochs, {"lr": [h["lr"] for h in history]}),
    ]
    facts = (f"best epoch {best} of {len(history)}: validation top-1 "
             f"{final.get('val_top1', float('nan')):.4f}, top-5 "
             f"{final.get('val_top5', float('nan')):.4f}, loss "
             f"{final.get('val_loss', float('nan')):.4f}; "
             f"{final.get('train_images_per_sec', float('nan')):.0f} training images/s")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>"
            f"{html.escape(title)}</title></head><body style='font-family:sans-serif'>"
            f"<h3>{html.escape(title)}</h3><p>{html.escape(facts)}</p>"
            f"<div>{''.join(charts)}</div></body></html>\n")


def evaluation_html(confusion_png: bytes, metrics: dict) -> str:
    """The evaluation as one page: headline figures, the confusion-matrix picture, per class."""
    rows = "".join(
        f"<tr><td>{html.escape(r['class'])}</td><td>{r['precision']:.4f}</td>"
        f"<td>{r['recall']:.4f}</td><td>{r['f1']:.4f}</td><td>{r['support']}</td></tr>"
        for r in metrics["per_class"])
    picture = base64.b64encode(confusion_png).decode("ascii")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>Evaluation</title></head>"
            "<body style='font-family:sans-serif'>"
            f"<h3>Evaluation: {metrics['rows']} images, accuracy {metrics['accuracy']:.4f}, "
            f"top-{metrics['top_k']} {metrics['top5_accuracy']:.4f}</h3>"
            f"<img alt='confusion matrix' src='data:image/png;base64,{picture}'/>"
            "<table border='1' cellpadding='3' style='border-collapse:collapse'>"
            "<tr><th>class</th><th>precision</th><th>recall</th><th>F1</th><th>support</th></tr>"
            f"{rows}</table></body></html>\n")
