"""A script's requirements file, read before pip sees it: which lines point into the packed
source (the script's own packages) and which name third-party packages, with every path resolved
against the file's own folder inside the snapshot, not against whatever folder pip runs in.

    reqs = read(Path("work/src/requirements.txt"), Path("work/src"))
    reqs.third_party   # ("numpy>=2", "--extra-index-url https://...")  -> the cached environment
    reqs.constraints   # the lines of its `-c FILE`s                    -> beside the pins
    reqs.local         # (Local("-e .", "-e /work/src"), ...)          -> installed per job

A line is local when it is a path (`.`, `./libs/x`, `libs/x[extra]`, `/abs`), a `file:` URL
(`file:libs/x`, `name @ file:///...`) or an editable of either (`-e .`). `-r FILE` is read in
place (its paths against its own folder); `--find-links DIR` is made absolute. A relative path
that leaves the snapshot is an error: the pod has nothing there.

`check_pins` (render) refuses a line the image's pinned packages cannot satisfy (with
`packaging`, PyPA's reading of requirement specifiers); the rest is stdlib: the pod's boot reads
files here too.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from kfvision.pipelines.script.snapshot import InvalidSourceError

_VCS = ("git+", "hg+", "svn+", "bzr+")
_NAME_AT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*(?:\[[^\]]*\])?)\s*@\s*(\S+)(.*)$")
_EXTRAS = re.compile(r"^(.*?)(\[[^\]/]*\])?$")
_OPTION = re.compile(r"^(-[a-zA-Z]|--[a-z-]+)(?:[= ]\s*|(?<=^-[a-zA-Z]))(.*)$")
_PATH_OPTIONS = ("-f", "--find-links")  # their value is a folder: made absolute
_INCLUDE, _CONSTRAIN, _EDITABLE = ("-r", "--requirement"), ("-c", "--constraint"), \
    ("-e", "--editable")


@dataclass(frozen=True)
class Local:
    """One line that installs from the snapshot: as written, and as pip gets it (absolute)."""

    written: str
    line: str
    path: Path


@dataclass(frozen=True)
class Requirements:
    """A requirements file split (module docstring); `files`: the files read, first the top."""

    third_party: tuple
    constraints: tuple
    local: tuple
    files: tuple


def logical_lines(text: str) -> list:
    """pip's lines of a requirements file: `\\` continuations joined, comments and blanks
    dropped (a `#` starts a comment at the start or after white space)."""
    out, pending = [], ""
    for raw in text.splitlines():
        if raw.endswith("\\"):
            pending += raw[:-1]
            continue
        line = re.sub(r"(^|\s+)#.*$", "", pending + raw).strip()
        pending = ""
        if line:
            out.append(line)
    return out


def _inside(path: Path, root: Path, written: str, where: str) -> Path:
    path = path.resolve()
    if path != root and root not in path.parents:
        raise InvalidSourceError(
            f"{where}: {written!r} points outside the packed source ({path}); a job has only "
            "the snapshot: move the package into --source, or give --source a folder above "
            "both.")
    return path


def _file_url_path(url: str, folder: Path) -> Path:
    """The path of a `file:` URL (`file:x`, `file:./x`, `file:///abs`), against `folder`."""
    parsed = urlparse(url)
    path = unquote(parsed.path if parsed.netloc in ("", "localhost") else "//" + parsed.netloc +
                   parsed.path)
    return folder / path


def is_local(spec: str) -> bool:
    """Whether a requirement (the text after any `-e`) installs from a path or `file:` URL."""
    if spec.startswith(_VCS) or re.match(r"^[a-z][a-z0-9+.-]*://", spec) and \
            not spec.startswith("file:"):
        return False
    m = _NAME_AT.match(spec)
    if m:
        return m.group(2).startswith("file:")
    if spec.startswith(("file:", ".", "/", "~")):
        return True
    head = re.split(r"[;\s]", spec, maxsplit=1)[0]
    return "/" in head or "\\" in head


def _local(spec: str, folder: Path, root: Path, where: str, editable: bool) -> Local:
    written = ("-e " if editable else "") + spec
    m = _NAME_AT.match(spec)
    if m:  # name[extra] @ file:...
        path = _inside(_file_url_path(m.group(2), folder), root, written, where)
        line = f"{m.group(1)} @ {path.as_uri()}{m.group(3)}"
    else:
        head, _, marker = spec.partition(";")
        head = head.strip()
        target, extras = _EXTRAS.match(head).groups()
        path = _file_url_path(target, folder) if target.startswith("file:") else \
            folder / Path(target).expanduser()
        path = _inside(path, root, written, where)
        line = f"{path}{extras or ''}" + (f" ;{marker}" if marker else "")
    return Local(written, ("-e " if editable else "") + line, path)


def read(path: Path, root: Path) -> Requirements:
    """The requirements file `path` (inside the unpacked snapshot `root`), split.

    Raises:
        InvalidSourceError: it (or a file it includes) is unreadable, or a path leaves `root`.
    """
    root, seen = Path(root).resolve(), []
    third, constraints, local = [], [], []

    def walk(file: Path, into: list) -> None:
        file = _inside(file, root, str(file), "requirements")
        if file in seen:
            return  # a file included twice (or in a loop) counts once
        seen.append(file)
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as e:
            raise InvalidSourceError(f"cannot read the requirements {file}: {e}") from e
        where = str(file.relative_to(root))
        for line in logical_lines(text):
            m = _OPTION.match(line)
            option, value = (m.group(1), m.group(2).strip()) if m else (None, line)
            if option in _INCLUDE:
                walk(file.parent / value, into)
            elif option in _CONSTRAIN:
                walk(file.parent / value, constraints)
            elif option in _EDITABLE or (option is None and is_local(line)):
                editable = option in _EDITABLE
                if is_local(value):
                    local.append(_local(value, file.parent, root, where, editable))
                else:
                    into.append(line)  # -e git+https://...: from elsewhere, cached
            elif option in _PATH_OPTIONS and not re.match(r"^[a-z]+://", value):
                into.append(f"{option} {(file.parent / value).resolve()}")
            else:
                into.append(line)

    walk(Path(path), third)
    return Requirements(tuple(third), tuple(constraints), tuple(local),
                        tuple(str(f.relative_to(root)) for f in seen))


def check_pins(lines, pins: dict, where: str) -> None:
    """Refuse a requirement of `lines` that the image's `pins` ({name: version}) cannot
    satisfy: kfvision keeps the image's torch and torchvision, so the pod would fail.

    Raises:
        InvalidSourceError: which line, the image's version, and what to do.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    pinned = {canonicalize_name(n): (n, v) for n, v in pins.items()}
    for line in lines:
        if line.startswith("-"):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue  # pip says what is wrong with it, at install
        name, version = pinned.get(canonicalize_name(req.name), (None, None))
        if name is None or req.url or req.specifier.contains(version, prereleases=True):
            continue
        raise InvalidSourceError(
            f"{where}: {line!r} cannot be met in the image, which has {name} {version} (the job "
            f"keeps the image's {name}): drop the line or allow {version}; another version of "
            f"{name} needs an image that has it (--image); --no-check-requirements skips this "
            "check.")


def check_file(source: Path, requirements: str, pins: bool) -> None:
    """Read a job's requirements file (`requirements`, relative to the source folder `source`)
    as the pod will, its local paths inside the source, and with `pins` refuse a line the
    image's torch or torchvision cannot meet (`check_pins`): said at render, not by every pod.

    Raises:
        InvalidSourceError: a path leaves the source, or a line cannot be met.
    """
    from kfvision.pipelines.script.env import pins as image_pins

    reqs = read(Path(source) / requirements, Path(source))
    if pins:
        check_pins(reqs.third_party, dict(p.split("==", 1) for p in image_pins()),
                   f"{requirements} (--source {source})")
