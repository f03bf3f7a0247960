"""What `tune run` leaves besides the best model: trials.csv, study.json and tuning.png (the
objective per trial, and against each searched parameter; Pillow only, as the other pictures)."""

import csv
import math
from pathlib import Path

from PIL import Image, ImageDraw

from kfvision.pipelines.tune.experiment import Search
from kfvision.trainer.fileio import atomic_write_json
from kfvision.trainer.use.plot import load_font

PANEL, MARGIN = 260, 36
DOT = {"COMPLETE": (8, 48, 107), "PRUNED": (200, 120, 0), "FAIL": (180, 0, 0)}


def _rows(study, search: Search) -> list:
    rows = []
    for t in study.get_trials(deepcopy=False):
        rows.append({"number": t.number, **{p.name: t.params.get(p.name) for p in search.params},
                     "state": t.state.name, "objective": t.value,
                     "best_epoch": t.user_attrs.get("best_epoch"),
                     "seconds": t.user_attrs.get("seconds")})
    return rows


def write_outputs(study, search: Search, out: Path) -> dict:
    """Write trials.csv, study.json and tuning.png into `out`; returns study.json's contents."""
    rows = _rows(study, search)
    with open(out / "trials.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["number", *[p.name for p in search.params],
                                               "state", "objective", "best_epoch", "seconds"])
        writer.writeheader()
        writer.writerows(rows)
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    best = None
    if complete:
        b = study.best_trial
        best = {"number": b.number, "params": b.params, "value": b.value,
                "best_epoch": b.user_attrs.get("best_epoch"), "model": str(out / "best")}
    summary = {"objective": search.objective, "direction": study.direction.name.lower(),
               "algorithm": search.algorithm, "early_stopping": search.early_stopping,
               "trials": search.trials, "parallel": search.parallel,
               "parameters": [p.katib() for p in search.params],
               "states": {s: sum(r["state"] == s for r in rows) for s in DOT},
               "best": best}
    atomic_write_json(out / "study.json", summary)
    plot(rows, search, out / "tuning.png")
    return summary


def _panel(draw, box, points, xlabel: str, ylabel: str, log_x: bool) -> None:
    x0, y0, x1, y1 = box
    font = load_font(11)
    draw.rectangle(box, outline=(120, 120, 120))
    draw.text((x0, y1 + 4), xlabel, fill=(0, 0, 0), font=font)
    draw.text((x0, y0 - 16), ylabel, fill=(0, 0, 0), font=font)
    pts = [(x, y, s) for x, y, s in points if x is not None and y is not None]
    if not pts:
        return
    xs = [math.log10(x) if log_x else x for x, _, _ in pts]
    ys = [y for _, y, _ in pts]
    xlo, xhi, ylo, yhi = min(xs), max(xs), min(ys), max(ys)
    for (_, _, state), x, y in zip(pts, xs, ys, strict=True):
        px = x0 + 8 + (x - xlo) / ((xhi - xlo) or 1) * (x1 - x0 - 16)
        py = y1 - 8 - (y - ylo) / ((yhi - ylo) or 1) * (y1 - y0 - 16)
        draw.ellipse((px - 3, py - 3, px + 3, py + 3), fill=DOT.get(state, (0, 0, 0)))
    draw.text((x1 - 60, y0 + 2), f"{yhi:.4g}", fill=(90, 90, 90), font=font)
    draw.text((x1 - 60, y1 - 14), f"{ylo:.4g}", fill=(90, 90, 90), font=font)


def plot(rows: list, search: Search, path: Path) -> None:
    """The objective per trial number, then against each searched parameter (log axis for log
    ranges; categorical values by position). Dots: blue complete, orange pruned."""
    panels = 1 + len(search.params)
    img = Image.new("RGB", (panels * (PANEL + MARGIN) + MARGIN, PANEL + 2 * MARGIN), "white")
    draw = ImageDraw.Draw(img)
    done = [r for r in rows if r["objective"] is not None]
    for i in range(panels):
        x0 = MARGIN + i * (PANEL + MARGIN)
        box = (x0, MARGIN, x0 + PANEL, MARGIN + PANEL)
        if i == 0:
            pts = [(r["number"], r["objective"], r["state"]) for r in done]
            _panel(draw, box, pts, "trial", search.objective, False)
            continue
        p = search.params[i - 1]
        pos = (lambda v, p=p: p.choices.index(v) if v in p.choices else None) \
            if p.type == "categorical" else (lambda v: v)
        pts = [(pos(r[p.name]), r["objective"], r["state"]) for r in done]
        _panel(draw, box, pts, p.name + (" (log)" if p.log else ""), search.objective, p.log)
    img.save(path)
