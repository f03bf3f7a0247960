"""run-local's stand-in for a pod's filesystem and user: each local pod process runs under
bubblewrap (`bwrap`, Debian's `bubblewrap`), so that what fails in the pod fails here.

What a sandboxed process sees (`wrap`):
- the machine's root filesystem read-only (the pod's `readOnlyRootFilesystem: true`): a write
  there fails with `[Errno 30] Read-only file system`, the pod's error;
- writable only where the pod mounts a writable volume: its emptyDirs, ConfigMaps (read-only, as
  in a pod) and generic ephemeral volumes under run-local's folder for the pod
  (pipelines/jobs/volumes.py), its own /dev/shm (a tmpfs, the emptyDir's sizeLimit as its size),
  /tmp when the pod mounts a volume there (the machine's /tmp, shared by the pods), its PVC mount
  paths, and the folders of this machine the job names by path in its arguments and env (the
  local stand-ins for the PVCs a cluster would mount there: the data, --out, --output-uri);
- the pod's securityContext user and group (runAsUser/runAsGroup, the container's over the
  pod's), in a user namespace of its own;
- the pod's variables: HOME and the caches on the pod's home volume (pipelines/jobs/home.py),
  never the caller's.
The network, the process ids and the machine's other devices stay shared: the pods' rendezvous
runs over the loopback address, and run-local stops and counts the pods' processes by pid
(pipelines/jobs/procs.py). The pod's memory limit is pipelines/jobs/memlimit.py.

Without bwrap (or where it cannot make a user namespace) run-local says so in one line and runs
as before; `--no-sandbox` opts out.
"""

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

BWRAP = "bwrap"
# Never made writable, even when a job names a path under them: the system and the Python that
# stands in for the image's.
_SYSTEM = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/sbin", "/sys",
           "/usr", "/var", "/run")
HOST_TMP, SHM = "/tmp", "/dev/shm"
_BINARY_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6,
                  "G": 10**9, "T": 10**12}


def memory_bytes(text) -> int:
    """A Kubernetes memory quantity (512Mi, 2G, 1000000) in bytes."""
    text = str(text).strip()
    for suffix, factor in sorted(_BINARY_SUFFIX.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(suffix):
            return int(float(text[:-len(suffix)]) * factor)
    return int(float(text))


@functools.cache
def probe() -> tuple:
    """(bwrap's path or None, why not): bwrap is installed and can make the user namespace
    run-local needs (a container may forbid it)."""
    exe = shutil.which(BWRAP)
    if exe is None:
        return None, "bubblewrap (bwrap) is not installed (apt-get install bubblewrap)"
    try:
        done = subprocess.run([exe, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-user",
                               "--uid", "1000", "--gid", "1000", "--size", "1048576", "--perms",
                               "1777", "--tmpfs", SHM, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{exe} does not start: {e}"
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        return None, f"{exe} cannot make a user namespace here ({why[-1] if why else 'no reason'})"
    return exe, ""


def choose(sandbox: bool | None, say) -> str | None:
    """bwrap's path when the pods run sandboxed (`sandbox`: True/None = when possible, False =
    not); else None, said once through `say` unless the caller opted out."""
    if sandbox is False:
        return None
    exe, why = probe()
    if exe is None:
        say(f"run-local cannot enforce the pod's filesystem (read-only root, its volumes, its "
            f"user): {why}; running with this machine's filesystem and user (--no-sandbox "
            "silences this)")
    return exe


@dataclass(frozen=True)
class Pod:
    """What the sandbox takes from one rendered pod (`pod_view`)."""

    uid: int | None = None
    gid: int | None = None
    read_only_root: bool = True
    tmp: bool = False  # a volume is mounted at /tmp
    shm_bytes: int | None = None  # the /dev/shm emptyDir's sizeLimit
    pvc_paths: tuple = ()
    config_paths: tuple = ()  # ConfigMap mount paths (read-only in a pod)
    memory_limit: int | None = None  # bytes
    names: tuple = field(default=())  # what the job names by path (args, env values)


def pod_view(pod: dict, container: dict, env: dict | None = None) -> Pod:
    """The sandbox's view of `pod` (a PodSpec: volumes, securityContext) running `container`
    (its volumeMounts, securityContext, resources, args; `env` its values)."""
    psc, csc = pod.get("securityContext") or {}, container.get("securityContext") or {}
    by_name = {v.get("name"): v for v in pod.get("volumes") or []}
    pvc, config, tmp, shm = [], [], False, None
    for m in container.get("volumeMounts") or []:
        path, v = m["mountPath"].rstrip("/") or "/", by_name.get(m.get("name")) or {}
        tmp = tmp or path == HOST_TMP
        if path == SHM and (v.get("emptyDir") or {}).get("sizeLimit"):
            shm = memory_bytes(v["emptyDir"]["sizeLimit"])
        elif "persistentVolumeClaim" in v:
            pvc.append(path)
        elif "configMap" in v:
            config.append(path)
    limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    return Pod(uid=csc.get("runAsUser", psc.get("runAsUser")),
               gid=csc.get("runAsGroup", psc.get("runAsGroup")),
               read_only_root=bool(csc.get("readOnlyRootFilesystem")), tmp=tmp, shm_bytes=shm,
               pvc_paths=tuple(pvc), config_paths=tuple(config),
               memory_limit=memory_bytes(limit) if limit is not None else None,
               names=(*(str(a) for a in container.get("args") or []), *(env or {}).values()))


def _protected(path: Path) -> bool:
    text = str(path)
    ours = Path(__file__).parents[1]  # kfvision's pipelines/ (and trainer/ beside it)
    prefixes = (*_SYSTEM, sys.prefix, sys.base_prefix, str(ours), str(ours.parent / "trainer"))
    return len(path.parts) <= 2 or any(text == p or text.startswith(p.rstrip("/") + "/")
                                      for p in prefixes)


def stand_ins(names, cwd: Path) -> list:
    """The folders of this machine that `names` (arguments, `--flag=value`s, env values) name by
    path, each the nearest existing folder of the path: what a cluster would mount as a PVC.
    Paths under the system, this Python, kfvision itself or the machine's /tmp are left out."""
    found = []
    for name in names:
        value = name.split("=", 1)[1] if name.startswith("-") and "=" in name else name
        if not value or "://" in value or "\n" in value or os.pathsep in value:
            continue
        path = Path(value) if value.startswith("/") else cwd / value
        if not value.startswith("/") and not (path.exists() or ("/" in value
                                                                 and path.parent.is_dir())):
            continue  # a word, not a path
        path = Path(os.path.abspath(path))
        while not path.exists():
            path = path.parent
        if not path.is_dir():
            path = path.parent
        if _protected(path) or path == Path(HOST_TMP) or Path(HOST_TMP) in path.parents:
            continue
        if path not in found:
            found.append(path)
    return found


def wrap(bwrap: str, argv: list, pod: Pod, root, cwd=None) -> list:
    """`argv` run by bwrap inside `pod`'s filesystem; `root`: run-local's folder of the pod's own
    volumes (None: it has none)."""
    cwd = Path(cwd or os.getcwd())
    out = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
           "--die-with-parent", "--unshare-user", "--unshare-ipc"]
    if pod.uid is not None:
        out += ["--uid", str(pod.uid), "--gid", str(pod.gid if pod.gid is not None else pod.uid)]
    for dev in sorted(Path("/dev").glob("nvidia*")):  # the pod's GPUs: CUDA_VISIBLE_DEVICES
        out += ["--dev-bind", str(dev), str(dev)]
    if pod.shm_bytes:
        out += ["--size", str(pod.shm_bytes)]
    out += ["--perms", "1777", "--tmpfs", SHM]
    writable = [*(Path(p) for p in pod.pvc_paths if Path(p).exists()),
                *stand_ins(pod.names, cwd)]
    if pod.tmp:
        writable.append(Path(HOST_TMP))
    if root is not None:
        writable.append(Path(root))
    for path in writable:
        out += ["--bind", str(path), str(path)]
    for path in pod.config_paths:  # read-only over the pod's writable folder, as in a pod
        local = Path(root) / path.lstrip("/") if root is not None else Path(path)
        if local.exists():
            out += ["--ro-bind", str(local), str(local)]
    return [*out, "--chdir", str(cwd), "--", *argv]


def pod_argv(bwrap: str | None, argv: list, pod: dict, container: dict, env: dict, say,
             cwd=None) -> tuple:
    """(argv, MemoryLimit or None) of one local pod: inside its filesystem when `bwrap` is given
    and the pod's root is read-only (a writable root is not reproduced: it runs as it is, said
    through `say`), in a memory cgroup of its limit when it has one (pipelines/jobs/memlimit.py).
    """
    from kfvision.pipelines.contract import POD_ROOT
    from kfvision.pipelines.jobs.memlimit import MemoryLimit

    if bwrap is None:
        return argv, None
    view = pod_view(pod, container, {k: v for k, v in env.items()
                                     if k in {e.get("name") for e in container.get("env") or []}})
    memory = None if view.memory_limit is None else MemoryLimit.make(view.memory_limit, say)
    if view.read_only_root:
        argv = wrap(bwrap, argv, view, env.get(POD_ROOT), cwd)
    else:
        say("the pod's root filesystem is writable (no readOnlyRootFilesystem): run-local runs "
            "it with this machine's filesystem")
    return (argv if memory is None else memory.wrap(argv)), memory
