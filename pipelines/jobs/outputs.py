"""`kfvision job download NAME PATH`: a file or folder of what a user's script job kept after
success, `model/...` or `outputs/...` (the names they have under --output-uri).

Where NAME's outputs are:
- a local run (`job run-local`, `job run`): node 0's pod folder under the run's log folder
  (`build/jobs/NAME/pods/master-0` or `node-0-0`), whose boot left them there, and a mark that
  it succeeded (pipelines/contract.py RESULTS, SUCCEEDED);
- a job on the cluster: the URI in its annotation `kfvision.dev/output-uri` (render writes it
  from --output-uri), an s3:// prefix fetched through pipelines/clients/s3sync.py. A PVC or pod
  path is not reachable from here: the error says where the files are.
"""

import json
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from kfvision.pipelines import contract
from kfvision.pipelines.jobs.errors import JobOutputsError

SHOWN = 20  # files named when PATH is not there


def check_path(path: str) -> str:
    """PATH as a relative POSIX path below the outputs (`model/model.pt`, `outputs`)."""
    parts = PurePosixPath(path.strip("/")).parts
    if not parts or ".." in parts or parts[0] not in contract.RESULTS:
        raise JobOutputsError(f"PATH {path!r} must start with one of "
                              f"{', '.join(f'{n}/' for n in contract.RESULTS)} (the folders a "
                              "script job keeps), without '..'.")
    return "/".join(parts)


def _missing(path: str, where: str, have: list) -> JobOutputsError:
    shown = ", ".join(have[:SHOWN]) + (f" and {len(have) - SHOWN} more" if len(have) > SHOWN
                                       else "")
    return JobOutputsError(f"{path} is not among the outputs at {where}, which hold "
                           f"{len(have)} file(s): {shown or 'none'}.")


def local_run(name: str, log_dir: Path) -> Path | None:
    """Node 0's work folder of a local run of job `name` in `log_dir`, or None (no local run).

    Raises:
        JobOutputsError: the run did not succeed (or runs still).
    """
    from kfvision.pipelines.jobs.kinds import KINDS

    pods = Path(log_dir) / "pods"
    for kind in KINDS.values():
        work = pods / kind.primary / contract.WORK_MOUNT.lstrip("/")
        if work.is_dir():
            if not (work / contract.SUCCEEDED).is_file():
                raise JobOutputsError(f"the local run of job {name} in {log_dir} has not "
                                      "succeeded (it failed, or runs still): node 0 keeps its "
                                      "outputs only after success. Run it again with `kfvision "
                                      "job run-local`.")
            return work
    return None


def result_folders(work: Path) -> dict:
    """name -> folder under `work`, as node 0's success marker records them (the boot's
    ./outputs is where the script ran), else contract.RESULTS."""
    try:
        marked = json.loads((work / contract.SUCCEEDED).read_text())
    except (OSError, ValueError):
        marked = {}
    marked = marked if isinstance(marked, dict) else {}
    return {name: marked.get(name, sub) for name, sub in contract.RESULTS.items()}


def from_local(work: Path, path: str, out: Path) -> Path:
    """Copy `path` of node 0's work folder `work` into `out`; the copy's path."""
    rel = PurePosixPath(path)
    folders = result_folders(work)
    found = work / folders[rel.parts[0]] / Path(*rel.parts[1:])
    if not found.exists():
        have = sorted(f"{name}/{p.relative_to(work / sub).as_posix()}"
                      for name, sub in folders.items()
                      for p in (work / sub).rglob("*") if p.is_file())
        raise _missing(path, str(work), have)
    target = out / rel.name
    out.mkdir(parents=True, exist_ok=True)
    if found.is_dir():
        shutil.copytree(found, target, dirs_exist_ok=True)
    else:
        shutil.copy2(found, target)
    return target


def empty_note(work: Path, path: str, got: Path) -> str | None:
    """What to say when `path` of a local run came as an empty folder: it is empty, what the
    job did keep, and the folders its script left in the pod (node 0's marker names them)."""
    if not got.is_dir() or any(got.iterdir()):
        return None
    folders = result_folders(work)
    have = sorted(f"{name}/{p.relative_to(work / sub).as_posix()}"
                  for name, sub in folders.items() for p in (work / sub).rglob("*")
                  if p.is_file())
    shown = ", ".join(have[:SHOWN]) + (f" and {len(have) - SHOWN} more" if len(have) > SHOWN
                                       else "")
    note = f"{path} is empty: the script wrote nothing there. The job kept: {shown or 'nothing'}."
    try:
        left = json.loads((work / contract.SUCCEEDED).read_text()).get("left") or {}
    except (OSError, ValueError, AttributeError):
        left = {}
    if left:
        note += (f" Left in the pod: {', '.join(f'{n}/' for n in left)}; render with --collect "
                 f"{next(iter(left))} to keep it, or write it under ./outputs.")
    return note


def output_uri(job: dict, where: str) -> str:
    """The --output-uri a rendered job carries.

    Raises:
        JobOutputsError: it has none (not a script job, or rendered without --output-uri).
    """
    uri = ((job.get("metadata") or {}).get("annotations") or {}).get(contract.OUTPUT_ANNOTATION)
    if not uri:
        raise JobOutputsError(f"{where} has no {contract.OUTPUT_ANNOTATION} annotation: it was not "
                              "rendered with `--source ... --output-uri URI`, so its outputs "
                              "stayed in its pods.")
    return uri


def from_uri(uri: str, path: str, out: Path) -> Path:
    """Fetch `path` below the outputs URI `uri` (s3://) into `out`; the copy's path.

    Raises:
        JobOutputsError: `uri` is not s3://, or holds no `path`.
    """
    if not uri.startswith("s3://"):
        raise JobOutputsError(f"the outputs are at {uri}, on a volume of the cluster, not in "
                              "object storage: copy them from a pod that mounts it (`kubectl "
                              "cp POD:PATH .`), or render with --output-uri s3://....")
    from kfvision.pipelines.clients import s3, s3sync

    root = uri.rstrip("/") + "/"
    _, prefix = s3.split_uri(root)
    have = sorted(o.key[len(prefix):] for o in s3.list_objects(root))
    is_dir = any(k.startswith(path + "/") for k in have)
    if path not in have and not is_dir:
        raise _missing(path, uri, have)
    out.mkdir(parents=True, exist_ok=True)
    target = out / PurePosixPath(path).name
    with tempfile.TemporaryDirectory(prefix=".kfvision-download-", dir=out) as tmp:
        got = s3sync.fetch(root + path + ("/" if is_dir else ""), Path(tmp), progress=False)
        if is_dir:
            (got.path / s3sync.JOURNAL).unlink(missing_ok=True)
            shutil.copytree(got.path, target, dirs_exist_ok=True)
        else:
            shutil.move(got.path, target)
    return target
