"""The job of a user's own script: the same PyTorchJob or TrainJob as the built-in trainer's (same
pods, hardening, devices, volumes, retry contract), whose container runs `python -I -u -m
kfvision.pipelines.script.boot ... -- SCRIPT ARGS` (pipelines/script/boot.py) instead, plus the
source snapshot's transport:

- a small snapshot (its base64 within the ConfigMap limit) travels in the rendered file itself, as
  an immutable ConfigMap named by its sha256, written before the job and mounted read-only into
  the training container;
- a bigger one is uploaded once to `--source-store s3://...` as `<prefix>/<sha256>.tar.gz`
  (skipped when that object is there), or read from a PVC (`--source-pvc`), and fetched and
  hash-checked by the boot.

    docs = build_script_job(job_config, ScriptConfig(source="proj", entry="train.py",
                            args=("--epochs", "3")), snap, transport, kind=PYTORCHJOB)
    # -> [ConfigMap, PyTorchJob] (or [PyTorchJob] when the snapshot travels another way)

Pure functions, no I/O: `choose_transport` decides, pipelines/script/assemble.py ships.
"""

import base64
import re
from dataclasses import dataclass, replace

from kfvision.pipelines.contract import OUTPUT_ANNOTATION, WORK_MOUNT
from kfvision.pipelines.jobs.config import LABELS, JobConfig
from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.script.boot import ISOLATED
from kfvision.pipelines.script.snapshot import ARCHIVE_NAME, Snapshot
from kfvision.trainer.config import TrainConfig
from kfvision.trainer.options import ref_of
from kfvision.trainer.tracking import JOB_NAME

BOOT_COMMAND = ("python", *ISOLATED, "kfvision.pipelines.script.boot")
LAUNCHERS = ("torchrun", "python")
SOURCE_VOLUME, SOURCE_MOUNT = "kfvision-source", "/kfvision/source"
WORK_VOLUME = "kfvision-work"  # mounted at contract.WORK_MOUNT
SHA_ANNOTATION = "kfvision.dev/source-sha256"
# Kubernetes v1.33 pkg/apis/core/types.go MaxSecretSize (1 MiB), which
# pkg/apis/core/validation/validation.go ValidateConfigMap applies to the sum of a ConfigMap's
# data and binaryData. We count the base64 text the manifest carries, not the decoded bytes: the
# whole object must also pass etcd's request limit (--max-request-bytes, 1.5 MiB by default).
CONFIGMAP_LIMIT = 1024 * 1024
# Client-side `kubectl apply` copies the whole object into its annotation
# kubectl.kubernetes.io/last-applied-configuration, and an object's annotations may hold at most
# 256 KiB (Kubernetes v1.33.0 staging/src/k8s.io/apimachinery/pkg/api/validation/objectmeta.go,
# totalAnnotationSizeLimitB): a bigger ConfigMap needs `kubectl apply --server-side`, `kubectl
# create` or `kfvision job submit` (which creates it).
CLIENT_APPLY_LIMIT = 256 * 1024
# What a user's --env may not set: the launchers' and platforms' own variables (Kubeflow Trainer's
# webhook refuses the PET_* names in trainer.env: pipelines/jobs/trainjob/rules.py PET_NAMES).
RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "PYTHONUNBUFFERED")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CHANNEL = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,62}")
# The trainer flags a JobConfig carries are not used by a script's job: the command is replaced.
NO_TRAINER = TrainConfig(model="-", train="-", val="-", out="-")


@dataclass(frozen=True)
class ScriptConfig:
    """A user's script: where it is, how to start it, what it reads and where its results go."""

    source: str
    entry: str | None = None
    module: str | None = None
    args: tuple = ()
    requirements: str | None = None
    workdir: str | None = None  # relative to source; None: the source's root
    launcher: str = "torchrun"
    inputs: tuple = ()  # ((name, uri), ...)
    output_uri: str | None = None
    env: tuple = ()  # ((name, value), ...)
    collect: tuple = ()  # folders the script writes, kept under ./outputs
    call: str | None = None  # with module: a console script's function (`module:call`)
    console_script: str | None = None  # its name in [project.scripts], its argv[0]

    @property
    def target(self) -> str:
        if self.call:
            return f"{self.console_script} ({self.module}:{self.call})"
        return self.entry or f"-m {self.module}"


@dataclass(frozen=True)
class Transport:
    """How the snapshot reaches the pods: `configmap`, `s3` (uri) or `pvc` (path as pods see
    it)."""

    how: str
    where: str  # the boot's --snapshot


def configmap_name(sha256: str) -> str:
    return f"kfvision-src-{sha256}"


def encoded_size(snap: Snapshot) -> int:
    """The snapshot's size as a ConfigMap's binaryData carries it (base64)."""
    return 4 * ((snap.size + 2) // 3)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def choose_transport(snap: Snapshot, store: str | None, pvc_dir: str | None) -> Transport:
    """A store or PVC folder when given, else the ConfigMap when it fits.

    Raises:
        InvalidJobError: too big for a ConfigMap and no other transport given.
    """
    if store:
        if not store.startswith("s3://"):
            raise InvalidJobError(f"--source-store {store!r} is not an s3:// URI (s3://BUCKET/"
                                  "PREFIX).")
        return Transport("s3", f"{store.rstrip('/')}/{snap.sha256}.tar.gz")
    if pvc_dir:
        if not pvc_dir.startswith("/"):
            raise InvalidJobError(f"--source-pvc {pvc_dir!r} must be an absolute path under a "
                                  "--pvc mount, as the pods see it.")
        return Transport("pvc", f"{pvc_dir.rstrip('/')}/{snap.sha256}.tar.gz")
    if encoded_size(snap) > CONFIGMAP_LIMIT:
        raise InvalidJobError(
            f"the source snapshot is too big for a ConfigMap: {len(snap.files)} files, "
            f"{_mib(snap.size)} packed, {_mib(encoded_size(snap))} as base64 (limit "
            f"{_mib(CONFIGMAP_LIMIT)}); give --source-store s3://BUCKET/PREFIX or --source-pvc "
            "DIR, or leave big files out with a .kfvisionignore.")
    return Transport("configmap", f"{SOURCE_MOUNT}/{ARCHIVE_NAME}")


def config_map(snap: Snapshot, namespace: str | None = None) -> dict:
    """The immutable ConfigMap that carries the snapshot (named by its sha256)."""
    metadata = {"name": configmap_name(snap.sha256)}
    if namespace:
        metadata["namespace"] = namespace
    metadata["labels"] = {**LABELS, "app.kubernetes.io/component": "source"}
    metadata["annotations"] = {SHA_ANNOTATION: snap.sha256}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "immutable": True,
            "binaryData": {ARCHIVE_NAME: base64.b64encode(snap.data).decode("ascii")}}


def fits_client_side_apply(cm: dict) -> bool:
    """Whether `kubectl apply -f` (client-side) can take the ConfigMap `cm`: its JSON, which
    kubectl writes into an annotation, within the annotation limit (1 KiB kept for the rest)."""
    import json

    return len(json.dumps(cm, separators=(",", ":"))) + 1024 <= CLIENT_APPLY_LIMIT


def _pvc_path(uri: str, cfg: JobConfig, what: str) -> str:
    """`pvc://CLAIM/sub/path` as the pods see it (under that claim's --pvc mount)."""
    claim, _, sub = uri[len("pvc://"):].partition("/")
    mount = next((v.mount for v in cfg.volumes if v.claim == claim), None)
    if mount is None:
        raise InvalidJobError(f"{what} {uri}: claim {claim!r} is not mounted; add --pvc "
                              f"{claim}:/mnt/{claim}.")
    return f"{mount.rstrip('/')}/{sub}".rstrip("/")


def _location(uri: str, cfg: JobConfig, what: str) -> str:
    if uri.startswith("pvc://"):
        return _pvc_path(uri, cfg, what)
    if uri.startswith(("s3://", "/")):
        return uri
    raise InvalidJobError(f"{what} {uri!r} is neither s3://..., pvc://CLAIM/PATH nor an "
                          "absolute path as the pods see it.")


def check_script(cfg: JobConfig, script: ScriptConfig, kind) -> None:
    """Raise InvalidJobError for a script setting the job of `kind` (a JobKind) cannot carry."""
    if bool(script.entry) == bool(script.module):
        raise InvalidJobError("give the script as --entry FILE, --module NAME or "
                              "--console-script NAME (one of them).")
    if script.launcher not in LAUNCHERS:
        raise InvalidJobError(f"--launcher {script.launcher!r} is not one of "
                              f"{', '.join(LAUNCHERS)}.")
    if script.launcher == "python" and cfg.procs_per_node not in (None, 1):
        procs = ref_of(JobConfig, "procs_per_node")
        raise InvalidJobError(f"--launcher python runs one process per pod, not {procs} "
                              f"{cfg.procs_per_node}; use --launcher torchrun for several.")
    from kfvision.pipelines.jobs.trainjob.rules import PET_PREFIX

    for name, _ in script.env:
        if not _ENV_NAME.fullmatch(name):
            raise InvalidJobError(f"--env {name}: not a variable name.")
        if name.startswith(PET_PREFIX) or name in RESERVED_ENV:
            raise InvalidJobError(f"--env {name}: the platform sets it ({kind.sets_env}); "
                                  "drop it.")
    seen = set()
    for name, uri in script.inputs:
        if not _CHANNEL.fullmatch(name) or name.lower() in seen:
            raise InvalidJobError(f"--input {name}={uri}: the name must be letters, digits, "
                                  "'-' or '_' (a letter first), each name once.")
        seen.add(name.lower())


def _boot_args(cfg: JobConfig, script: ScriptConfig, transport: Transport, sha256: str,
               hosts: list) -> list:
    args = ["--sha256", sha256, "--snapshot", transport.where]
    args += ["--entry", script.entry] if script.entry else ["--module", script.module]
    if script.call:
        args += ["--call", script.call, "--console-script", script.console_script]
    if script.requirements:
        args += ["--requirements", script.requirements]
    if script.workdir:
        args += ["--workdir", script.workdir]
    args += ["--launcher", script.launcher]
    if cfg.volumes:  # checkpoints and TensorBoard logs outlive a restarted pod there
        args += ["--state", f"{cfg.volumes[0].mount.rstrip('/')}/kfvision/{cfg.name}"]
    for name, uri in script.inputs:
        args += ["--input", f"{name}={_location(uri, cfg, '--input')}"]
    for folder in script.collect:
        args += ["--collect", folder]
    if script.output_uri:
        args += ["--output-uri", _location(script.output_uri, cfg, "--output-uri")]
    args += ["--hosts", ",".join(hosts), "--gpus", str(cfg.gpus_per_node)]
    return [*args, "--", *script.args]


def _mounts(transport: Transport, sha256: str) -> tuple:
    """(volumes, volumeMounts) the boot needs: its scratch emptyDir, and the ConfigMap."""
    volumes = [{"name": WORK_VOLUME, "emptyDir": {}}]
    mounts = [{"name": WORK_VOLUME, "mountPath": WORK_MOUNT}]
    if transport.how == "configmap":
        volumes.append({"name": SOURCE_VOLUME, "configMap": {"name": configmap_name(sha256)}})
        mounts.append({"name": SOURCE_VOLUME, "mountPath": SOURCE_MOUNT, "readOnly": True})
    return volumes, mounts


def build_script_job(cfg: JobConfig, script: ScriptConfig, snap: Snapshot, transport: Transport,
                     kind, runtime=None) -> list:
    """[ConfigMap (when it carries the snapshot), job] for a user's script (module docstring):
    the job of `kind` (a JobKind; a TrainJob on `runtime`: as render_job takes it).

    Raises:
        InvalidJobError: a rule of the cluster or of the script settings is broken.
    """
    from kfvision.pipelines.jobs.render import render_command_job

    check_script(cfg, script, kind)
    if script.launcher == "python":
        cfg = replace(cfg, procs_per_node=1)
    env = (*cfg.env, *script.env)
    if JOB_NAME not in {n for n, _ in env}:  # Azure's Run and register_model name the job
        env = (*env, (JOB_NAME, cfg.name))
    cfg = replace(cfg, train=NO_TRAINER, env=env)
    args = _boot_args(cfg, script, transport, snap.sha256, kind.pod_hosts(cfg.name, cfg.nodes))
    volumes, mounts = _mounts(transport, snap.sha256)
    annotations = {SHA_ANNOTATION: snap.sha256, **(
        {OUTPUT_ANNOTATION: script.output_uri} if script.output_uri else {})}
    job = render_command_job(cfg, kind, runtime, BOOT_COMMAND, args, volumes=volumes,
                             mounts=mounts, annotations=annotations)
    if transport.how == "configmap":
        return [config_map(snap, cfg.namespace), job]
    return [job]
