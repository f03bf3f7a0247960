"""run-local's stand-in for a pod's memory limit (`resources.limits.memory`): a memory cgroup of
the pod's own, where this machine lets run-local make one (root, or a delegated cgroup), so that
a job the kubelet would kill for memory is killed here too, and the log says so as
`kubectl describe pod` does (`OOMKilled`).

cgroup v2 (`memory.max`, `memory.events` oom_kill) or v1 (`memory.limit_in_bytes`,
`memory.oom_control` oom_kill): a child of the cgroup run-local itself is in. Where neither can
be made, the limit is not enforced and run-local says so once.
"""

import contextlib
import uuid
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
OOM_EXIT = 137  # 128 + SIGKILL: how the kernel's OOM killer ends the pod's process


def _own(controller: str) -> str | None:
    """This process's cgroup path in the v1 `controller` hierarchy, or in v2's ("")."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            if (controller == "" and names == "") or controller in names.split(","):
                return path
    return None


def _parent() -> tuple:
    """(folder under which a pod's memory cgroup can be made, its version), or (None, why)."""
    v2 = _own("")
    if v2 is not None and (CGROUP / "cgroup.controllers").exists():
        base = CGROUP / v2.lstrip("/")
        if "memory" in (base / "cgroup.subtree_control").read_text(errors="replace").split():
            return base, 2
    v1 = _own("memory")
    if v1 is not None and (CGROUP / "memory").is_dir():
        return CGROUP / "memory" / v1.lstrip("/"), 1
    return None, "this machine has no memory cgroup run-local can use"


class MemoryLimit:
    """One pod's memory cgroup: `wrap` an argv to start in it, `oom_killed` after it ended."""

    def __init__(self, folder: Path, version: int, limit: int):
        self.folder, self.version, self.limit = folder, version, limit
        self.kills = 0  # the kernel's count when last asked: a restarted pod starts again

    @classmethod
    def make(cls, limit: int, say) -> "MemoryLimit | None":
        """The cgroup for a pod of `limit` bytes, or None (said through `say`)."""
        parent, version = _parent()
        if parent is not None:
            folder = parent / f"kfvision-pod-{uuid.uuid4().hex[:12]}"
            try:
                folder.mkdir()
                (folder / ("memory.max" if version == 2 else "memory.limit_in_bytes")
                 ).write_text(str(limit))
                return cls(folder, version, limit)
            except OSError as e:
                version = f"cannot make a cgroup in {parent} ({e.strerror})"
                with contextlib.suppress(OSError):
                    folder.rmdir()
        say(f"the pod's memory limit is not enforced here: {version}")
        return None

    def wrap(self, argv: list) -> list:
        """`argv` started inside this cgroup (the shell moves itself in, then becomes argv); made
        again if a stop removed it before a restart."""
        limit = self.folder / ("memory.max" if self.version == 2 else "memory.limit_in_bytes")
        return ["/bin/sh", "-c", f'mkdir -p "$0" && echo {self.limit} > "{limit}" && '
                'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.folder), *argv]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the pod for passing the limit since last
        asked."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.folder / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > self.kills:
                    self.kills = int(value)
                    return True
        return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.folder.rmdir()
