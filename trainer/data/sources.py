"""Which files of a conversion source are images of which class (the layouts `convert` accepts).

    class folders   SRC/cat/*.jpg, SRC/dog/*.jpg (images may sit in sub-folders of a class)
    wrapped         SRC/photos/cat/*.jpg ... (one wrapping folder, common in archives)
    labels CSV      SRC/**/*.jpg + a path,label CSV (see kfvision.trainer.data.labels)
    unlabelled      SRC/*.jpg with no class folders and no CSV (for scoring only)

Hidden files and folders (names starting with '.'), macOS `__MACOSX` folders and Windows
`Thumbs.db`/`desktop.ini` are ignored without a report. Symbolic links are followed only when
they point to a file inside the source; other links are reported and skipped.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

from kfvision.trainer.data.labels import read_labels_csv
from kfvision.trainer.errors import InvalidDatasetError

IGNORED = {"__MACOSX", "Thumbs.db", "desktop.ini"}


@dataclass(frozen=True, slots=True)  # one per candidate image: 200,000 of them are common
class Item:
    file: str  # where to read it (a path string: a Path object per image costs 4x the memory)
    rel: str  # its path inside the image directory
    label: str | None
    shown: str  # how reports name it: the source path the user gave + its place there


@dataclass
class Plan:
    classes: tuple[str, ...]
    items: list[Item]
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _ignored(name: str) -> bool:
    return name.startswith(".") or name in IGNORED


def _undecodable(name: str) -> bool:
    """A name that is not valid UTF-8 on disk (Python keeps its bytes as lone surrogates): it
    would break every file written later (manifest, scored CSV, metrics), so it is not used."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


_NOT_UTF8 = "name is not valid UTF-8 (rename it to use it)"


def walk_files(base: Path, root: Path, shown: str, skipped: list) -> list[tuple[str, str]]:
    """(path relative to `base`, '/'-separated; the file's path) for every usable file under
    base, sorted.

    Links to folders are not followed; links to files are kept only when they resolve inside
    `root` (the whole source), else reported in `skipped`.
    """
    found: list = []
    _walk(str(base), len(os.path.join(str(base), "")), root, os.path.realpath(root), shown,
          skipped, found)
    return sorted(found)


def _walk(d: str, cut: int, root: Path, real_root: str, shown: str, skipped: list,
          found: list) -> None:
    """os.walk's top-down order (its folders' reports, then its files', then each sub-folder),
    on os.scandir's entries: whether an entry is a link then needs no system call of its own."""
    try:
        with os.scandir(d) as it:
            entries = list(it)
    except OSError:
        return  # as os.walk: a folder that cannot be listed is passed over
    dirs, files = [], []
    for e in entries:
        try:
            is_dir = e.is_dir()
        except OSError:
            is_dir = False
        (dirs if is_dir else files).append(e)
    below = []
    for e in dirs:
        if _ignored(e.name):
            continue
        if _undecodable(e.name):
            skipped.append((_show(shown, root, e.path), "folder " + _NOT_UTF8))
        elif e.is_symlink():
            skipped.append((_show(shown, root, e.path), "link to a folder (not followed)"))
        else:
            below.append(e.path)
    for e in files:
        if _ignored(e.name):
            continue
        if _undecodable(e.name):
            skipped.append((_show(shown, root, e.path), "file " + _NOT_UTF8))
            continue
        if e.is_symlink():
            target = os.path.realpath(e.path)
            if os.path.commonpath([target, real_root]) != real_root:
                skipped.append((_show(shown, root, e.path),
                                "symbolic link pointing outside the source (not followed)"))
                continue
            if not os.path.isfile(target):
                skipped.append((_show(shown, root, e.path), "broken symbolic link"))
                continue
        found.append((_posix(e.path[cut:]), e.path))
    for sub in below:
        _walk(sub, cut, root, real_root, shown, skipped, found)


def _posix(rel: str) -> str:
    return rel if os.sep == "/" else rel.replace(os.sep, "/")


def relative_path(f: str, root) -> str:
    """The '/'-separated path of the file `f` (a path string) relative to the folder `root`."""
    prefix = str(root)
    if not prefix.endswith(os.sep):
        prefix += os.sep
    if f.startswith(prefix):
        return _posix(f[len(prefix):])
    return Path(f).relative_to(root).as_posix()  # e.g. root "." (its files are "a", not "./a")


def _show(shown: str, root: Path, f) -> str:
    # undecodable bytes shown as \xNN: the report must print on any terminal
    rel = os.fsencode(relative_path(str(f), root)).decode("utf-8", "backslashreplace")
    return f"{shown}/{rel}"


def _subdirs(d: Path) -> list[Path]:
    # a linked folder could lead anywhere (even out of the source): never a class folder
    return sorted(p for p in d.iterdir()
                  if p.is_dir() and not p.is_symlink() and not _ignored(p.name))


def _loose(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if not p.is_dir() and not _ignored(p.name))


def unwrap(root: Path, archive: bool) -> Path:
    """Skip wrapping folders: a lone folder with nothing beside it that holds folders itself.

    In an archive the lone top folder is always a wrapper (`tar czf photos.tgz photos/`), even
    when it holds images only.
    """
    top = root
    if archive and len(_subdirs(top)) == 1 and not _loose(top):
        top = _subdirs(top)[0]
    while len(_subdirs(top)) == 1 and not _loose(top) and _subdirs(_subdirs(top)[0]):
        top = _subdirs(top)[0]
    return top


def plan_source(root, *, shown: str, archive: bool = False, labels=None) -> Plan:
    """Decide the layout of `root` and list its candidate images (not yet decoded).

    Args:
        root: the source folder (or where an archive was extracted).
        shown: how to name the source in reports (the path the user gave).
        archive: root is an extracted archive (its lone top folder is a wrapper).
        labels: a path,label CSV: a file, or a path inside the source.
    """
    root = Path(root)
    if labels is not None:
        return _plan_labelled(root, shown, archive, labels)
    top = unwrap(root, archive)
    skipped: list = []
    classes = [d.name for d in _subdirs(top) if not _undecodable(d.name)]
    for d in _subdirs(top):
        if _undecodable(d.name):
            skipped.append((_show(shown, root, d), "class folder " + _NOT_UTF8))
    if not classes and not _subdirs(top):  # loose images only: unlabelled
        items = [Item(f, rel, None, _show(shown, root, f))
                 for rel, f in walk_files(top, root, shown, skipped)]
        return Plan((), items, skipped)
    for f in _loose(top):
        skipped.append((_show(shown, root, f), "not inside a class folder"))
    for d in sorted(top.iterdir()):
        if d.is_symlink() and d.is_dir() and not _ignored(d.name):
            skipped.append((_show(shown, root, d), "link to a folder (not followed)"))
    items = []
    for c in classes:
        items += [Item(f, f"{c}/{rel}", c, _show(shown, root, f))
                  for rel, f in walk_files(top / c, root, shown, skipped)]
    return Plan(tuple(classes), items, skipped)


def _labels_file(root: Path, labels) -> Path:
    path = Path(labels)
    if path.is_file():
        return path
    if not path.is_absolute() and (root / path).is_file():  # shipped inside the source
        return root / path
    raise InvalidDatasetError(
        f"labels file {labels} not found (looked on disk and inside the source). Give a CSV of "
        "path,label."
    )


def _plan_labelled(root: Path, shown: str, archive: bool, labels) -> Plan:
    csv_path = _labels_file(root, labels)
    mapping = read_labels_csv(csv_path)
    top = unwrap(root, archive)
    skipped: list = []
    used, items = set(), []
    csv_real = csv_path.resolve()
    for rel, f in walk_files(root, root, shown, skipped):
        if Path(f).resolve() == csv_real:
            continue
        # CSV paths may be relative to the source or to its wrapping folder
        rel_top = Path(f).relative_to(top).as_posix() if top in Path(f).parents else None
        key = rel if rel in mapping else rel_top if rel_top in mapping else None
        if key is None:
            skipped.append((_show(shown, root, f), "not listed in the labels file"))
            continue
        used.add(key)
        items.append(Item(f, f"{mapping[key]}/{key}", mapping[key], _show(shown, root, f)))
    for key in sorted(set(mapping) - used):
        skipped.append((f"{shown}/{key}", f"listed in {csv_path.name} but not found"))
    return Plan(tuple(sorted(set(mapping.values()))), items, skipped)
