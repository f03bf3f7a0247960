"""run-local's stand-in for a pod's own volumes: the ConfigMap, emptyDir and generic ephemeral
mounts of the training container, as folders of this machine.

A pod's ConfigMap volume (a user's source snapshot: pipelines/script/manifest.py), its emptyDirs
(the boot's scratch folder, an s3:// job's scratch) and its generic ephemeral volumes (a PVC made
with the pod and deleted with it: `--scratch-class`) are the pod's alone; a local process cannot
mount them at their paths. So each pod gets a folder ROOT (under the run's log folder), every
such mount at path P becomes ROOT/P (a ConfigMap's keys written there as files), and the pod's
environment names ROOT in KFVISION_POD_ROOT, which the boot and the node agent resolve their
paths under (pipelines/contract.py: pod_path; contract.SCRATCH_ENV). /dev/shm and /tmp stay
the machine's own, and PVC mounts are used at their paths, as for the built-in trainer. A
restarted replica keeps its folder, as a container restarted in the same pod keeps its
emptyDirs.
"""

import base64
import shutil
from pathlib import Path

from kfvision.pipelines.contract import POD_ROOT
from kfvision.pipelines.jobs.errors import InvalidJobError

HOST_MOUNTS = ("/dev/shm", "/tmp")  # the machine's own, shared as the built-in trainer does
POD_OWN = {"configMap", "emptyDir", "ephemeral"}  # volume kinds that are the pod's own folder


def trainjob_pod(job: dict, security: dict | None = None) -> tuple:
    """(pod volumes, the `node` container's volumeMounts) of a TrainJob's runtime patches;
    `security` (when given) gets their securityContexts: {"pod": ..., "container": ...}."""
    from kfvision.pipelines.jobs.trainjob.rules import NODE

    volumes, mounts, security = [], [], {} if security is None else security
    for patch in job["spec"].get("runtimePatches") or []:
        spec = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}
        for rjob in spec.get("replicatedJobs") or []:
            if rjob.get("name") != NODE:
                continue
            pod = rjob["template"]["spec"]["template"]["spec"]
            volumes += pod.get("volumes") or []
            security["pod"] = pod.get("securityContext") or security.get("pod")
            for c in pod.get("containers") or []:
                if c.get("name") == NODE:
                    mounts += c.get("volumeMounts") or []
                    security["container"] = c.get("securityContext") or security.get("container")
    return volumes, mounts


def materialize(volumes: list, mounts: list, config_maps: dict, root: Path,
                source: str = "the manifest", env: dict | None = None) -> dict:
    """Lay out the pod's ConfigMap, emptyDir and ephemeral mounts under `root` (emptied first); the
    environment that tells the pod where ({} when it has none): POD_ROOT, and each value of `env`
    that is a path under such a mount (HOME and the caches: pipelines/jobs/home.py) as its
    folder here.

    Raises:
        InvalidJobError: a ConfigMap the pod mounts is not in the file.
    """
    by_name = {v["name"]: v for v in volumes}
    local = []
    for m in mounts:
        v = by_name.get(m["name"]) or {}
        path = m["mountPath"].rstrip("/")
        if path in HOST_MOUNTS or not POD_OWN.intersection(v):
            continue
        local.append((path, v))
    if not local:
        return {}
    root = Path(root).absolute()  # the pod's processes run in other folders (the script's own)
    if root.exists():
        shutil.rmtree(root)
    for path, v in local:
        folder = root / path.lstrip("/")
        folder.mkdir(parents=True, exist_ok=True)
        if "configMap" in v:
            name = v["configMap"].get("name")
            cm = config_maps.get(name)
            if cm is None:
                raise InvalidJobError(f"{source}: the pod mounts ConfigMap {name!r}, which the "
                                      "file does not hold; run-local uses only the ConfigMaps "
                                      "written in the same file (as `job render --source` "
                                      "writes them).")
            for key, text in (cm.get("data") or {}).items():
                (folder / key).write_text(text, encoding="utf-8")
            for key, b64 in (cm.get("binaryData") or {}).items():
                (folder / key).write_bytes(base64.b64decode(b64))
    moved = {POD_ROOT: str(root)}
    for name, value in (env or {}).items():
        for path, _ in local:
            if value == path or value.startswith(path + "/"):
                moved[name] = str(root) + value
    return moved
