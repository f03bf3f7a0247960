"""What a training job is, whichever kind runs it: `JobConfig` (its options, declared once), the
parsers and checks of those options, and the pod both kinds run (`pod_spec`).

    cfg = JobConfig(name="digits", image="...", train=train_config, nodes=2, procs_per_node=4,
                    gpus_per_node=4)
    build_pytorchjob(cfg)   # pipelines/jobs/pytorchjob/build.py
    build_trainjob(cfg)     # pipelines/jobs/trainjob/build.py

The container runs `python -m kfvision.trainer.launch -m kfvision.trainer.train <training flags>`:
torchrun (its own code, see trainer/launch.py) with exit codes that keep their meaning, so that a
retry policy on exit codes (the PyTorchJob's `restartPolicy: ExitCode`, kfvision's TrainJob runtime)
retries a lost peer or a killed process (128-255; the run resumes from its last checkpoint) and
fails bad input at once (1-127): see docs/faults.md. torchrun takes --nnodes, --nproc-per-node,
--node-rank,
--master-addr and --master-port from the `PET_*` variables both platforms inject, and sets
per-process RANK/LOCAL_RANK/WORLD_SIZE itself (see ../shared/reference/README.md). So no
`--standalone` and no rendezvous flags here.

A job whose --train/--val/--model/--out is an `s3://` URI runs the node agent
(`contract.STORE_COMMAND`) with the same flags instead, on a scratch volume and with no PVC:
pipelines/jobs/storejob.py.

Pods meet the Kubernetes "restricted" Pod Security Standard: non-root, no privilege escalation,
all capabilities dropped, RuntimeDefault seccomp, only emptyDir, generic ephemeral and PVC
volumes; the root filesystem is read-only (an emptyDir at /tmp takes what torchrun and Python
write there, another HOME and the caches: pipelines/jobs/home.py).
"""

import re
from dataclasses import dataclass, fields
from typing import NamedTuple

from kfvision.pipelines.clients.cluster import namespace_option
from kfvision.pipelines.clients.k8s import GPU_RESOURCE, dns1035_problem, dns1123_problem
from kfvision.pipelines.contract import SCRATCH_MOUNT, STORE_COMMAND
from kfvision.pipelines.jobs import storejob
from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.home import home_env, home_mount, home_volume
from kfvision.pipelines.jobs.pytorchjob.rules import RESTART_POLICIES
from kfvision.trainer.config import TrainConfig
from kfvision.trainer.errors import InvalidParameterError, ref
from kfvision.trainer.options import check_options, option, ref_of

TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
TRAIN_COMMAND = ("python", "-m", "kfvision.trainer.launch", "-m", "kfvision.trainer.train")
TMP_MOUNT = "/tmp"  # writable scratch on a read-only root filesystem (torchrun's log folder)
LABELS = {"app.kubernetes.io/name": "kfvision", "app.kubernetes.io/component": "train"}
# The regex Kubernetes (and the CRD schema) uses for resource quantities such as 500m or 16Gi.
_QUANTITY = re.compile(r"[+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                       r"([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?")
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*"
                        r"[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


class Toleration(NamedTuple):
    """`key[=value]:effect`; no value means operator Exists."""

    key: str
    value: str | None
    effect: str


class Volume(NamedTuple):
    """A PersistentVolumeClaim mounted into every replica."""

    claim: str
    mount: str


def parse_key_value(text: str) -> tuple:
    """A node selector's 'key=value' -> (key, value)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise InvalidJobError(f"{ref_of(JobConfig, 'node_selector')} item {text!r} is not "
                              "KEY=VALUE; give e.g. cloud.google.com/gke-accelerator=nvidia-l4.")
    return key, value


def parse_toleration(text: str) -> Toleration:
    """'key[=value]:Effect' -> Toleration."""
    keyvalue, sep, effect = text.rpartition(":")
    if not sep or not keyvalue:
        raise InvalidJobError(f"{ref_of(JobConfig, 'tolerations')} item {text!r} is not "
                              "KEY[=VALUE]:EFFECT; give e.g. nvidia.com/gpu:NoSchedule.")
    key, has_value, value = keyvalue.partition("=")
    return Toleration(key, value if has_value else None, effect)


def show_toleration(t: Toleration) -> str:
    """What parse_toleration reads back."""
    return f"{t.key}{'' if t.value is None else '=' + t.value}:{t.effect}"


def parse_volume(text: str) -> Volume:
    """'claim:/mount/path' -> Volume."""
    claim, sep, mount = text.partition(":")
    if not sep or not claim or not mount:
        raise InvalidJobError(f"{ref_of(JobConfig, 'volumes')} item {text!r} is not "
                              "CLAIM:MOUNT; give e.g. data:/mnt/data.")
    return Volume(claim, mount)


@dataclass(frozen=True)
class JobConfig:
    """Everything a training job (PyTorchJob or TrainJob) depends on. Its options are declared
    once, here: the `kfvision job render` flags and the pipeline's job parameters come from these
    fields."""

    name: str = option(help="job name (DNS-1035: a-z, 0-9, '-')")
    image: str = option(help="the trainer image the pods run", doc="The pipeline's steps run it "
                        "too.", pipeline=True)
    train: TrainConfig
    namespace: str | None = namespace_option("the one kubectl/submit uses")
    nodes: int = option(1, "pods: 1 Master + (N-1) Workers", low=1, high=10_000, pipeline=True)
    procs_per_node: int | None = option(None, "training processes per pod", low=1, high=1024,
                                        unset="one per GPU, or 1", pipeline=True,
                                        flag="--nproc-per-node",  # torchrun's, as train's
                                        aliases=("--procs-per-node",))
    gpus_per_node: int = option(0, f"{GPU_RESOURCE} per pod", low=0, high=64, pipeline=True)
    node_selector: tuple = option((), "node label the pods require", many=True,
                                  parse=parse_key_value, show="=".join, metavar="KEY=VALUE",
                                  pipeline=True)
    tolerations: tuple = option((), "taint the pods tolerate (nvidia.com/gpu:NoSchedule is "
                                "added when GPUs are asked for)", flag="--toleration",
                                many=True, parse=parse_toleration, show=show_toleration,
                                metavar="KEY[=VALUE]:EFFECT", pipeline=True)
    cpu: str | None = option(None, "CPU request per pod (e.g. 8, 500m)", pipeline="cpu_per_node")
    memory: str | None = option(None, "memory request per pod (e.g. 32Gi)",
                                pipeline="memory_per_node")
    shm_size: str | None = option(None, "size limit of the memory-backed /dev/shm (e.g. 8Gi)",
                                  pipeline=True)
    restart_policy: str = option("ExitCode", "what a failed pod gets", doc="ExitCode retries "
                                 "only exit codes 128-255 (killed, evicted), not kfvision's own "
                                 "errors.", choices=RESTART_POLICIES)
    backoff_limit: int = option(3, "restarts before the job fails", low=0, high=1000)
    active_deadline: int | None = option(None, "fail the job after this many seconds", low=1,
                                         metavar="SECONDS", unset="no limit",
                                         pipeline="timeout_seconds")
    ttl: int | None = option(None, "delete the finished job after this many seconds", low=0,
                             metavar="SECONDS")
    volumes: tuple = option((), "PersistentVolumeClaim to mount in every pod", flag="--pvc",
                            many=True, parse=parse_volume, show=":".join, metavar="CLAIM:MOUNT")
    run_as_user: int = option(1000, "non-root uid (and gid) of the pods", low=1)  # 0: root
    s3_credentials: str | None = option(
        None, "Secret whose AWS_* keys the pods get, by reference", doc="Each of "
        f"{', '.join(storejob.S3_SECRET_KEYS)} that the Secret holds becomes the variable of "
        "its name (env valueFrom.secretKeyRef, optional): the endpoint and the credentials of "
        "s3:// data, models and outputs. No value is ever written into the job.",
        metavar="SECRET")
    service_account: str | None = option(
        None, "ServiceAccount of the pods", doc="For IRSA / workload identity: the role bound "
        "to it reads and writes the s3:// paths.", metavar="NAME",
        unset="the namespace's default", pipeline=True)
    scratch_size: str | None = option(
        None, "size of each pod's scratch volume for s3:// jobs (e.g. 100Gi)", doc="Where the "
        f"node agent keeps what it fetches and writes ({SCRATCH_MOUNT}): an emptyDir's "
        "sizeLimit, or the request of --scratch-class's volume.", unset="no limit",
        pipeline=True)
    scratch_class: str | None = option(
        None, "StorageClass of a per-pod volume for the scratch (needs --scratch-size)",
        doc="A generic ephemeral volume (a PVC made and deleted with the pod) instead of the "
        "emptyDir on the node's own disk.", metavar="CLASS", unset="an emptyDir",
        pipeline=True)
    labels: tuple = ()  # extra ((key, value), ...) on the job and its pods
    env: tuple = ()  # extra ((name, value), ...) in the training container (MLflow's variables)

    @property
    def nproc(self) -> int:
        if self.procs_per_node is not None:
            return self.procs_per_node
        return self.gpus_per_node or 1

    def validate(self) -> "JobConfig":
        """Raise InvalidJobError (InvalidParameterError) for anything the cluster refuses."""
        name = ref_of(JobConfig, "name")
        problem = dns1035_problem(name, self.name)
        if problem:
            raise InvalidJobError(problem + ".")
        longest = (f"{self.name}-worker-{self.nodes - 2}" if self.nodes > 1
                   else f"{self.name}-master-0")
        if len(longest) > 63:
            raise InvalidJobError(
                f"{name} {self.name!r} is too long for {self.nodes} node(s): the operator names "
                f"a Service per pod, up to {longest!r} ({len(longest)} characters, limit 63). "
                f"Use a name of at most {63 - len(longest) + len(self.name)} characters.")
        namespace = ref_of(JobConfig, "namespace")
        if self.namespace is not None and dns1123_problem(namespace, self.namespace):
            raise InvalidJobError(dns1123_problem(namespace, self.namespace) + ".")
        if not self.image or any(ch.isspace() for ch in self.image):
            raise InvalidJobError(f"{ref_of(JobConfig, 'image')} {self.image!r} is not an image "
                                  "reference; give one such as "
                                  "registry.example.com/kfvision-trainer:0.1.0.")
        try:
            check_options(self)  # ranges and choices, as declared
        except InvalidParameterError as e:
            raise InvalidJobError(e.template) from None
        self._check_devices()
        for field in ("cpu", "memory", "shm_size", "scratch_size"):
            value = getattr(self, field)
            if value is not None and not _QUANTITY.fullmatch(value):
                raise InvalidJobError(f"{ref_of(JobConfig, field)} {value!r} is not a "
                                      "Kubernetes quantity (examples: 4, 500m, 16Gi, 1.5G).")
        self._check_scheduling()
        self._check_volumes()
        self._check_store()
        return self

    def _check_devices(self) -> None:
        g, p = self.gpus_per_node, self.nproc
        gpus, procs = ref_of(JobConfig, "gpus_per_node"), ref_of(JobConfig, "procs_per_node")
        if g > 0 and p > g:
            raise InvalidJobError(
                f"{procs} {p} is more than {gpus} {g}: each training process drives one GPU. "
                f"Use {procs} {g} (or fewer), or ask for {p} GPUs.")
        if g == 0 and self.train.device == "cuda":
            raise InvalidJobError(f"{ref('device')} cuda needs GPUs but {gpus} is 0; give {gpus} "
                                  f"N, or use {ref('device')} auto/cpu.")

    def _check_scheduling(self) -> None:
        for key, value in (*self.node_selector, *self.labels):
            if not (_LABEL_KEY.fullmatch(key) and len(key.split("/")[-1]) <= 63):
                raise InvalidJobError(f"label key {key!r} is not valid (e.g. "
                                      "cloud.google.com/gke-accelerator, or gpu).")
            if not (_LABEL_VALUE.fullmatch(value) and len(value) <= 63):
                raise InvalidJobError(f"label value {value!r} (of {key}) is not valid: at most "
                                      "63 letters, digits, '-', '_' and '.'.")
        tolerations = ref_of(JobConfig, "tolerations")
        for t in self.tolerations:
            if t.effect not in TAINT_EFFECTS:
                raise InvalidJobError(f"{tolerations} {t.key}: effect {t.effect!r} is not one "
                                      f"of {', '.join(TAINT_EFFECTS)}.")
            if not _LABEL_KEY.fullmatch(t.key):
                raise InvalidJobError(f"{tolerations} key {t.key!r} is not a valid taint key.")

    def _check_store(self) -> None:
        for field in ("s3_credentials", "service_account"):
            value = getattr(self, field)
            if value is not None and dns1123_problem(ref_of(JobConfig, field), value, True):
                raise InvalidJobError(dns1123_problem(ref_of(JobConfig, field), value,
                                                      True) + ".")
        size, cls = ref_of(JobConfig, "scratch_size"), ref_of(JobConfig, "scratch_class")
        if self.scratch_class is not None:
            if dns1123_problem(cls, self.scratch_class, True):
                raise InvalidJobError(dns1123_problem(cls, self.scratch_class, True) + ".")
            if self.scratch_size is None:
                raise InvalidJobError(f"{cls} {self.scratch_class} needs {size}: a volume of "
                                      f"a StorageClass is made at a size; add e.g. {size} 100Gi.")
        given = [f for f in ("scratch_size", "scratch_class") if getattr(self, f) is not None]
        if given and not storejob.uses_store(self.train):
            raise InvalidJobError(f"{ref_of(JobConfig, given[0])} is for a job whose --train, "
                                  "--val, --model or --out is an s3:// URI (its scratch volume); "
                                  "this one has none. Drop it.")

    def _check_volumes(self) -> None:
        mounts = ["/dev/shm", TMP_MOUNT, SCRATCH_MOUNT]
        pvc = ref_of(JobConfig, "volumes")
        for v in self.volumes:
            problem = dns1123_problem(f"{pvc} claim", v.claim, subdomain=True)
            if problem:
                raise InvalidJobError(problem + ".")
            if not v.mount.startswith("/") or v.mount.rstrip("/") in mounts:
                raise InvalidJobError(f"{pvc} {v.claim}:{v.mount}: the mount path must be "
                                      "absolute and used once (and not /dev/shm or /tmp).")
            mounts.append(v.mount.rstrip("/"))


def job_name(prefix: str, run_id: str) -> str:
    """A deterministic job name for a run: `<prefix>-<10 hex digits of sha256(run_id)>`.

    Derive it at run time (from the KFP run id), never at compile time, so a retried step
    re-attaches to its own job and two runs never share one.
    """
    import hashlib

    name = f"{prefix}-{hashlib.sha256(run_id.encode()).hexdigest()[:10]}"
    problem = dns1035_problem("job name", name)
    if problem or len(prefix) > 40:
        raise InvalidJobError(f"{problem or f'prefix {prefix!r} is too long'}: use a prefix of "
                              "at most 40 lower-case letters, digits and '-', starting with a "
                              "letter.")
    return name


def train_flags(cfg: TrainConfig) -> list:
    """The trainer's flags for `cfg`: the four paths, then every option that is not the default."""
    flags = []
    for f in fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.name in ("model", "train", "val", "out") or value != f.default:
            flags += ["--" + f.name.replace("_", "-"), str(value)]
    return flags


def container_env(cfg: JobConfig) -> list:
    """The container's extra `env` entries: HOME and the caches on the pod's home volume
    (pipelines/jobs/home.py) unless given, the given values in order, then the S3 credentials
    Secret's keys by reference."""
    return [*home_env(name for name, _ in cfg.env),
            *({"name": name, "value": value} for name, value in cfg.env),
            *storejob.secret_env(cfg.s3_credentials)]


def command(cfg: JobConfig) -> list:
    """The container's command: the trainer's launcher, or the node agent when a path is in the
    store (it takes the same flags)."""
    return list(STORE_COMMAND if storejob.uses_store(cfg.train) else TRAIN_COMMAND)


def resources(cfg: JobConfig) -> dict:
    """A pod's resources: the GPUs as a limit, CPU and memory as requests (what is given)."""
    requests = {k: v for k, v in (("cpu", cfg.cpu), ("memory", cfg.memory)) if v is not None}
    out = {"limits": {GPU_RESOURCE: cfg.gpus_per_node}} if cfg.gpus_per_node else {}
    if requests:
        out["requests"] = requests
    return out


def _container(cfg: JobConfig, name: str, ports: list) -> dict:
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    mounts += [{"name": f"pvc-{i}", "mountPath": v.mount} for i, v in enumerate(cfg.volumes)]
    mounts.append({"name": "tmp", "mountPath": TMP_MOUNT})
    mounts.append(home_mount())
    if storejob.uses_store(cfg.train):
        mounts.append(storejob.scratch_mount())
    env = container_env(cfg)
    return {
        "name": name,
        "image": cfg.image,
        "command": command(cfg),
        "args": train_flags(cfg.train),
        **({"env": env} if env else {}),
        **({"ports": ports} if ports else {}),
        **({"resources": asked} if (asked := resources(cfg)) else {}),
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]},
                            "readOnlyRootFilesystem": True},
        "volumeMounts": mounts,
    }


def pod_spec(cfg: JobConfig, container: str, ports: list = ()) -> dict:
    """The pod both kinds run: one training container named `container` (with `ports`), the
    hardening of the module docstring, /dev/shm, /tmp, the PVCs, the scratch volume of an s3://
    job, the service account, node selector, tolerations."""
    tolerations = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
                   ] if cfg.gpus_per_node else []
    for t in cfg.tolerations:
        tol = ({"key": t.key, "operator": "Exists", "effect": t.effect} if t.value is None else
               {"key": t.key, "operator": "Equal", "value": t.value, "effect": t.effect})
        if tol not in tolerations:
            tolerations.append(tol)
    # The default GPU taint key is common on managed clusters; tolerating it is harmless elsewhere.
    shm = {"medium": "Memory", **({"sizeLimit": cfg.shm_size} if cfg.shm_size else {})}
    volumes = [{"name": "dshm", "emptyDir": shm}]
    volumes += [{"name": f"pvc-{i}", "persistentVolumeClaim": {"claimName": v.claim}}
                for i, v in enumerate(cfg.volumes)]
    volumes.append({"name": "tmp", "emptyDir": {}})
    volumes.append(home_volume())
    if storejob.uses_store(cfg.train):
        volumes.append(storejob.scratch_volume(cfg.scratch_size, cfg.scratch_class))
    spec = {
        "automountServiceAccountToken": False,  # training pods never call the API
        "securityContext": {"runAsNonRoot": True, "runAsUser": cfg.run_as_user,
                            "runAsGroup": cfg.run_as_user, "fsGroup": cfg.run_as_user,
                            # chown a big PVC only when its root has the wrong group
                            "fsGroupChangePolicy": "OnRootMismatch",
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if cfg.service_account:
        # IRSA's token is a projected volume its webhook adds, workload identity's the metadata
        # server: neither needs the API token, which stays unmounted
        spec["serviceAccountName"] = cfg.service_account
    if cfg.node_selector:
        spec["nodeSelector"] = dict(sorted(cfg.node_selector))
    if tolerations:
        spec["tolerations"] = tolerations
    spec["containers"] = [_container(cfg, container, list(ports))]
    spec["volumes"] = volumes
    return spec
