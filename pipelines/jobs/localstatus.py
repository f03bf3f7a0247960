"""What a local run of a job records as it goes, for `kfvision job status` and `job list`: one
JSON file in the run's log folder, `LOG_DIR/status.json` (`build/jobs/NAME/status.json` for
`kfvision job run-local` and `job run`), rewritten (atomically) at most once a second while rank
0 prints `name=value` lines (pipelines/jobs/progress.py), and once when the run ends.

    {"name": "demo", "kind": "PyTorchJob", "nodes": 2, "procs": "2", "phase": "Running",
     "started": 1767323045.1, "pid": 4242, "message": "", "written": 1767323101.7,
     "progress": {"position": "epoch", "value": 3, "done": 4, "total": 10, "percent": 40,
                  "eta_s": 84.0, "metrics": {"epoch": 3, "loss": 0.41}, "updated": ...}}

Phases: Running, then Succeeded, Failed (`message`: the failure's line) or Stopped (Ctrl-C,
SIGTERM). A record that says Running while its run-local process (`pid`) is gone is read as
Stopped. Rank 0's lines are those of the job's rank-0 pod (master-0, node-0-0) that carry no
`[node/rank] ` prefix (the built-in trainer's) or `[0/0] ` (a user's script's).
"""

import json
import os
import threading
import time
from pathlib import Path

from kfvision.pipelines.jobs.kinds import kind_of
from kfvision.pipelines.jobs.progress import Progress, rank0_text, totals_of

RECORD = "status.json"
WRITE_EVERY_S = 1.0  # at most this often while lines come
RUNNING, SUCCEEDED, FAILED, STOPPED = "Running", "Succeeded", "Failed", "Stopped"


class Record:
    """The record of one local run (module docstring). Call it with each (replica, line) the
    run prints; use it as a context manager around the run, `succeeded(result)` at its end."""

    def __init__(self, job: dict, log_dir, clock=time.time):
        kind = kind_of(job)
        nodes, procs = kind.shape(job)
        self.path, self.primary, self.clock = Path(log_dir) / RECORD, kind.primary, clock
        self.progress = Progress(totals_of(kind.trainer_env(job)))
        self.data = {"name": job["metadata"]["name"], "kind": kind.kind, "nodes": nodes,
                     "procs": procs, "phase": RUNNING, "started": clock(), "pid": os.getpid(),
                     "message": ""}
        self.lock, self.dirty, self.stop = threading.Lock(), False, threading.Event()
        self.thread = threading.Thread(target=self._loop, name="local-status", daemon=True)

    def __enter__(self) -> "Record":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self.thread.start()
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.stop.set()
        self.thread.join(timeout=5.0)
        if error is None:
            return
        if isinstance(error, KeyboardInterrupt):  # Interrupted: run-local stopped every process
            self.end(STOPPED, "stopped by a signal; every process of the run was stopped")
        else:
            self.end(FAILED, (str(error).strip().splitlines() or [type(error).__name__])[0])

    def __call__(self, replica: str, line: str) -> None:
        if replica != self.primary:
            return
        text = rank0_text(line)
        if text is None:
            return
        with self.lock:
            if self.progress.feed(text, self.clock()):
                self.dirty = True

    def _loop(self) -> None:
        while not self.stop.wait(WRITE_EVERY_S):
            if self.dirty:
                self.write()

    def succeeded(self, result) -> None:
        """The run ended well; `result` its LocalResult."""
        self.data.update(seconds=round(result.seconds, 1), restarts=result.restarts)
        self.end(SUCCEEDED, "")

    def end(self, phase: str, message: str) -> None:
        self.data.update(phase=phase, message=message, ended=self.clock())
        self.write()

    def write(self) -> None:
        with self.lock:
            now = self.clock()
            record = {**self.data, "written": now, "progress": self.progress.snapshot(now)}
            self.dirty = False
        tmp = self.path.with_name(f".{RECORD}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)  # a reader never sees half a record


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # another user's process: not ours to judge
    return True


def read(log_dir, now: float | None = None) -> dict | None:
    """The record in `log_dir` as it stands at `now` (its time left counted down since it was
    written; Running without its process read as Stopped), or None when there is none."""
    path = Path(log_dir) / RECORD
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or "phase" not in record:
        return None
    now = time.time() if now is None else now
    if record["phase"] == RUNNING and not _alive(record.get("pid")):
        record.update(phase=STOPPED, message=f"its run-local process ({record.get('pid')}) is "
                      "gone: killed, or the machine restarted")
    progress = record.get("progress") or {}
    if progress.get("eta_s") is not None:
        since = max(0.0, now - record.get("written", now))
        progress["eta_s"] = max(0.0, progress["eta_s"] - since)
    record["log_dir"] = str(log_dir)
    return record


def read_all(root) -> list:
    """The records of every run under `root` (one folder per job), newest first."""
    root = Path(root)
    found = [read(p) for p in sorted(root.iterdir()) if p.is_dir()] if root.is_dir() else []
    return sorted((r for r in found if r), key=lambda r: -r.get("started", 0))
