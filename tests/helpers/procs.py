"""This machine's processes found by their environment (/proc/PID/environ), which every process a
test starts passes on to its own: how a test finds a pod's processes wherever they moved to (a
new session, a new process group) to kill them as a node's loss would."""

import contextlib
import os
import signal
from pathlib import Path


def environ(pid: str) -> dict:
    """Process `pid`'s environment ({} when it is gone or not ours)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                if "=" in item)


def with_env(**wanted) -> dict:
    """{pid: environment} of every process whose environment holds each of `wanted`."""
    return {p: env for p in os.listdir("/proc") if p.isdigit() for env in [environ(p)]
            if all(env.get(k) == v for k, v in wanted.items())}


def kill_with_env(**wanted) -> list:
    """SIGKILL every process whose environment holds `wanted`; their pids."""
    pids = [int(p) for p in with_env(**wanted)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # gone meanwhile
            os.kill(pid, signal.SIGKILL)
    return pids
