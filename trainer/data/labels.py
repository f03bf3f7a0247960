"""The labels CSV `kfvision convert --labels` reads: one row per image, `path,label`.

    path,label                 # header optional; also image/file/filename and class/category
    img/0001.jpg,cat           # path relative to the source folder (or archive root)
    img/0002.jpg,dog

Without a recognised header the first column is the path and the second the label. Extra columns
are ignored. Encoding is UTF-8 (a byte-order mark is fine).
"""

import csv
import posixpath
from pathlib import Path

from kfvision.trainer.errors import InvalidDatasetError

PATH_COLUMNS = ("path", "image", "file", "filename", "file_name", "image_path", "filepath")
LABEL_COLUMNS = ("label", "class", "category", "class_name")


def normalize_relpath(path: str) -> str | None:
    """'./a\\b.jpg' -> 'a/b.jpg'; None when the path is absolute or leaves its root."""
    p = path.strip().replace("\\", "/")
    if not p or p.startswith("/") or (len(p) > 1 and p[1] == ":"):
        return None
    p = posixpath.normpath(p)
    if p == ".." or p.startswith("../"):
        return None
    return p


def check_label(label: str, where: str) -> str:
    """A class name must be usable as a folder name; returns it stripped."""
    label = label.strip()
    if not label or label.startswith(".") or any(c in label for c in "/\\\0"):
        raise InvalidDatasetError(
            f"{where}: label {label!r} cannot be a class folder name (empty, starts with '.', "
            "or contains '/' or '\\'). Use plain class names such as 'cat'."
        )
    return label


def _columns(header: list[str]) -> tuple[int, int] | None:
    """(path column, label column) when `header` is a header row, else None."""
    names = [h.strip().lower() for h in header]
    path_col = next((i for i, n in enumerate(names) if n in PATH_COLUMNS), None)
    label_col = next((i for i, n in enumerate(names) if n in LABEL_COLUMNS), None)
    if path_col is None or label_col is None:
        return None
    return path_col, label_col


def read_labels_csv(path) -> dict[str, str]:
    """{normalised relative image path: class name} from a labels CSV.

    Raises:
        InvalidDatasetError: unreadable file, no rows, a row without a path or label, a path that
            leaves the source, a label that cannot be a folder name, or one path with two labels.
    """
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise InvalidDatasetError(
            f"labels file {path} cannot be read ({type(e).__name__}: {e}). Give a UTF-8 CSV with "
            "columns path,label."
        ) from e
    rows = [(n, r) for n, r in enumerate(rows, start=1) if any(c.strip() for c in r)]
    if not rows:
        raise InvalidDatasetError(f"labels file {path} is empty. Give one row per image: "
                                  "path,label.")
    cols = _columns(rows[0][1])
    if cols is not None:
        rows = rows[1:]
    path_col, label_col = cols or (0, 1)
    labels: dict[str, str] = {}
    for n, row in rows:
        where = f"{path}, line {n}"
        if len(row) <= max(path_col, label_col):
            raise InvalidDatasetError(f"{where}: expected a path and a label, got {row!r}.")
        rel = normalize_relpath(row[path_col])
        if rel is None:
            raise InvalidDatasetError(
                f"{where}: path {row[path_col]!r} is empty, absolute or leaves the source folder. "
                "Give paths relative to the source folder (or archive root)."
            )
        label = check_label(row[label_col], where)
        if labels.setdefault(rel, label) != label:
            raise InvalidDatasetError(
                f"{where}: {rel!r} is labelled both {labels[rel]!r} and {label!r}. Keep one row "
                "per image."
            )
    if not labels:
        raise InvalidDatasetError(f"labels file {path} has a header but no rows.")
    return labels
