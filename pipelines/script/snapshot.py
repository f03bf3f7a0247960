"""A user's source directory as one reproducible `.tar.gz`: same tree, same bytes, same sha256.

    snap = pack(Path("my_project"))      # -> Snapshot(data, sha256, files, left_out)
    unpack(snap.data, Path("work/src"))  # the pod side (pipelines/script/boot.py)

What is packed: every regular file under the directory, in sorted order, except
- `.git/` and `__pycache__/` folders (and `*.pyc`), always;
- folders that hold a `CACHEDIR.TAG` (the Cache Directory Tagging Specification, which GNU tar's
  `--exclude-caches` honours too): kfvision tags those it makes (`build/jobs`, a job's logs, the
  requirements cache), so a `--source .` never packs them; and the paths in `exclude` (the job's
  own YAML and log folder);
- what a `.gitignore` or `.kfvisionignore` (anywhere in the tree, git's rules: last match wins,
  `!` re-includes, a trailing `/` matches folders only, a pattern with a `/` is anchored to its
  file's folder, `**` spans folders) excludes;
- files that look like secrets (`.env`, private keys, cloud credential files, a service
  account's JSON key), unless named in `include` (paths relative to the directory): they are
  listed in `Snapshot.left_out` so that render can say so.

Every entry has mode 0644 (0755 when the owner may execute it), uid/gid 0, no owner names and
mtime 0, and the gzip header carries no name and mtime 0, so the archive depends on the files'
paths, contents and executable bits only. Stdlib only: the pod-side boot imports it too.
"""

import contextlib
import fnmatch
import gzip
import hashlib
import io
import json
import os
import re
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from kfvision.trainer.errors import KfvisionError

ARCHIVE_NAME = "source.tar.gz"  # the key in the ConfigMap, the file name everywhere else
ALWAYS_SKIPPED = (".git", "__pycache__")  # folders never packed
IGNORE_FILES = (".gitignore", ".kfvisionignore")
# Names that look like secrets: left out unless named explicitly (--include-secret).
SECRET_PATTERNS = (".env", ".env.*", "*.pem", "*.key", "*.p12", "*.pfx", "id_rsa*", "id_dsa*",
                   "id_ecdsa*", "id_ed25519*", ".netrc", "_netrc", ".pypirc", ".git-credentials",
                   ".dockercfg", "*.kubeconfig", "kubeconfig")
SECRET_PATHS = (".aws/credentials", ".aws/config", ".docker/config.json", ".kube/config",
                ".config/gcloud/application_default_credentials.json")
_CHUNK = 1 << 20
# https://bford.info/cachedir/: a file of this name that starts with this line marks its folder
CACHEDIR_TAG = "CACHEDIR.TAG"
CACHEDIR_SIGNATURE = b"Signature: 8a477f597d28d172789f06886806bc55"


def tag_made(folder: Path) -> None:
    """Mark `folder` (one kfvision made) as a cache, so that no snapshot packs it."""
    tag = Path(folder) / CACHEDIR_TAG
    if not tag.exists():
        with contextlib.suppress(OSError):  # a read-only place: nothing to pack there either
            tag.write_bytes(CACHEDIR_SIGNATURE + b"\n# made by kfvision: never packed into a "
                            b"job's source snapshot\n")


def _tagged(folder: Path) -> bool:
    try:
        with (folder / CACHEDIR_TAG).open("rb") as f:
            return f.read(len(CACHEDIR_SIGNATURE)) == CACHEDIR_SIGNATURE
    except OSError:
        return False


class InvalidSourceError(KfvisionError):
    """The source directory cannot be packed, or a snapshot is not what it should be."""


@dataclass(frozen=True)
class Snapshot:
    """A packed source directory: the archive's bytes and sha256, the packed paths, and the
    paths left out as secrets (relative, '/'-separated)."""

    data: bytes
    sha256: str
    files: tuple
    left_out: tuple = field(default=())

    @property
    def size(self) -> int:
        return len(self.data)


def _pattern_regex(pattern: str) -> str:
    """git's wildmatch for one pattern (no leading '!' or '/', no trailing '/'), as a regex."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("/**", i) and i + 3 == len(pattern):
            out.append("/.*")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 2)
            if end == -1:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:end]
                body = "^" + body[1:] if body.startswith("!") else body
                out.append(f"[{body.replace(chr(92), chr(92) * 2)}]")
                i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class _Rule:
    base: str  # the folder of the ignore file, relative ('' for the top)
    regex: re.Pattern
    negate: bool
    dir_only: bool

    def matches(self, rel: str, is_dir: bool) -> bool:
        if self.dir_only and not is_dir:
            return False
        if self.base:
            if not rel.startswith(self.base + "/"):
                return False
            rel = rel[len(self.base) + 1:]
        return bool(self.regex.fullmatch(rel))


def parse_ignore(text: str, base: str = "") -> list:
    """The rules of one .gitignore-style file whose folder is `base` (relative to the top)."""
    rules = []
    for raw in text.splitlines():
        line = raw.rstrip("\r")
        if not line.endswith("\\ "):
            line = line.rstrip(" ")
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        line = line[1:] if negate else line
        if line.startswith("\\"):  # \# and \! stand for themselves
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        line = line.lstrip("/")
        regex = _pattern_regex(line)
        if not anchored:
            regex = "(?:.*/)?" + regex
        rules.append(_Rule(base, re.compile(regex, re.DOTALL), negate, dir_only))
    return rules


def ignored(rules: list, rel: str, is_dir: bool) -> bool:
    """git's verdict for `rel` under `rules` (parents' files first): the last match decides."""
    verdict = False
    for rule in rules:
        if rule.matches(rel, is_dir):
            verdict = not rule.negate
    return verdict


def looks_secret(rel: str, path: Path) -> bool:
    """Whether a file looks like a credential: by name, by path, or a service account's key."""
    name = rel.rsplit("/", 1)[-1]
    if any(fnmatch.fnmatchcase(name, p) for p in SECRET_PATTERNS):
        return True
    if any(rel == p or rel.endswith("/" + p) for p in SECRET_PATHS):
        return True
    if name.endswith(".json") and path.stat().st_size < 64 * 1024:
        try:
            data = json.loads(path.read_bytes())
        except (ValueError, OSError):
            return False
        # Google Cloud's service-account key file (its "type" and "private_key" fields)
        return isinstance(data, dict) and data.get("type") == "service_account" and \
            "private_key" in data
    return False


def source_files(root: Path, include=(), exclude=()) -> tuple:
    """([(rel, path)...] to pack, sorted; [rel...] left out as secrets) of the folder `root`;
    `exclude`: paths (files or folders) never packed."""
    root = Path(root)
    if not root.is_dir():
        raise InvalidSourceError(f"--source {root} is not a folder; give the folder of your "
                                 "training script.")
    include = {Path(p).as_posix() for p in include}
    exclude = {Path(p).resolve() for p in exclude}
    packed, secrets = [], []

    def walk(folder: Path, rel_dir: str, rules: list) -> None:
        rules = list(rules)
        for name in IGNORE_FILES:
            f = folder / name
            if f.is_file():
                rules += parse_ignore(f.read_text(encoding="utf-8", errors="replace"), rel_dir)
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            path = Path(e.path)
            is_dir = path.is_dir()
            if exclude and path.resolve() in exclude:
                continue
            if is_dir and not path.is_symlink():
                if e.name in ALWAYS_SKIPPED or ignored(rules, rel, True) or _tagged(path):
                    continue
                walk(path, rel, rules)
                continue
            if not path.is_file() or e.name.endswith(".pyc") or ignored(rules, rel, False):
                continue  # sockets, dangling links, linked folders, byte code
            if path.is_symlink() and root.resolve() not in path.resolve().parents:
                continue  # a link out of the tree would pack someone else's file
            if rel not in include and looks_secret(rel, path):
                secrets.append(rel)
                continue
            packed.append((rel, path))

    walk(root, "", [])
    missing = sorted(include - {rel for rel, _ in packed})
    if missing:
        raise InvalidSourceError(f"--include-secret {missing[0]} is not a file of --source "
                                 f"{root} (give its path relative to the folder).")
    return sorted(packed), sorted(secrets)


def _info(rel: str, mode: int, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(rel)
    info.size, info.mtime, info.uid, info.gid, info.uname, info.gname = size, 0, 0, 0, "", ""
    info.mode = 0o755 if mode & stat.S_IXUSR else 0o644
    return info


def pack(root, include=(), exclude=()) -> Snapshot:
    """Pack the folder `root` reproducibly (see the module docstring).

    Args:
        include: secret-looking files to pack anyway (paths relative to `root`).
        exclude: paths never packed (kfvision's own output: the job's YAML, its logs).
    Raises:
        InvalidSourceError: `root` is not a folder, or an `include` path is not in it.
    """
    files, secrets = source_files(Path(root), include, exclude)
    buf = io.BytesIO()
    # compresslevel 6: zlib's default; mtime 0 and no file name keep the gzip header constant
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for rel, path in files:
            st = path.stat()
            with path.open("rb") as f:
                tar.addfile(_info(rel, st.st_mode, st.st_size), f)
    data = buf.getvalue()
    return Snapshot(data, hashlib.sha256(data).hexdigest(), tuple(r for r, _ in files),
                    tuple(secrets))


def verify(data: bytes, sha256: str, where: str) -> None:
    """Raise InvalidSourceError unless `data` hashes to `sha256`."""
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise InvalidSourceError(f"the source snapshot {where} has sha256 {got}, not {sha256} as "
                                 "the job says: it changed after render; render the job again.")


def unpack(data: bytes, dest: Path) -> list:
    """Unpack a snapshot into the (new or emptied) folder `dest`; returns the paths. Only
    regular files inside `dest` are written (tarfile's `data` filter refuses anything else)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # Python before 3.10.12 / 3.11.4 (Debian bookworm's 3.11.2): its refusals by hand
            _refuse_unsafe(members, dest)
            tar.extractall(dest, members=members)
    return [m.name for m in members]


def _refuse_unsafe(members, dest: Path) -> None:
    """What tarfile's `data` filter refuses in a snapshot: anything but a regular file or a
    folder, and any path that leaves `dest`."""
    root = dest.resolve()
    for m in members:
        target = (root / m.name).resolve()
        if not (m.isfile() or m.isdir()) or (target != root and root not in target.parents):
            raise InvalidSourceError(f"the source snapshot holds {m.name!r}, which is not a "
                                     "regular file inside the source folder; pack it again "
                                     "with `kfvision job render --source`.")
