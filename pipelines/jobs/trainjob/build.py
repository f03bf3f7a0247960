"""The Kubeflow Trainer v2 TrainJob of a training run, and kfvision's runtime: pure functions.

    job = build_trainjob(JobConfig(name="digits", image="...", train=train_config, nodes=2,
                                   procs_per_node=2), RuntimeRef("kfvision-torch"))

The same JobConfig as the PyTorchJob (pipelines/jobs/pytorchjob/build.py), the same container
command
(`python -m kfvision.trainer.launch -m kfvision.trainer.train ...`: torchrun, which reads the torch
plugin's `PET_*` variables) and the same pod hardening, written as a TrainJob
(`trainer.kubeflow.org/v1alpha1`): `trainer` holds image, command, args, nodes, processes and
resources; what the pods also need (the data PVC, `/dev/shm`, `/tmp`, node selector, tolerations,
the non-root security context) goes into one `runtimePatches` entry owned by the manager
`kfvision.dev/render`.

What is retried is the runtime's business, not the TrainJob's: `build_runtime` writes kfvision's
(Cluster)TrainingRuntime, whose JobSet `failurePolicy` and Job `podFailurePolicy` give the
exit-code contract of docs/faults.md (1-127 fail the TrainJob at once, 128-255 restart every node
from the last checkpoint, at most `max_restarts` times). The stock `torch-distributed` runtime
has neither (see docs/jobs.md).
"""

from dataclasses import dataclass

from kfvision.pipelines.clients.k8s import dns1123_problem
from kfvision.pipelines.jobs.config import (
    LABELS,
    JobConfig,
    command,
    container_env,
    pod_spec,
    resources,
    train_flags,
)
from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.trainjob.rules import (
    ANCESTOR_LABEL,
    ANCESTOR_TRAINER,
    API_GROUP,
    API_VERSION,
    FRAMEWORK_LABEL,
    KIND,
    NODE,
    RUNTIME_KINDS,
    STOCK_RUNTIME,
    validate_trainjob,
)

MANAGER = "kfvision.dev/render"  # owner of our runtimePatches entry (a domain-prefixed path)
KFVISION_RUNTIME = "kfvision-torch"
PERMANENT_CODES = tuple(range(1, 128))  # trainer/exitcodes.py: 1-127 are never retried
MAX_RESTARTS = 3  # kfvision-torch's JobSet maxRestarts: the PyTorchJob's default backoffLimit
ISTIO_OFF = {"sidecar.istio.io/inject": "false"}


@dataclass(frozen=True)
class RuntimeRef:
    """The runtime a TrainJob references: `name` of a ClusterTrainingRuntime (or a namespaced
    TrainingRuntime). The pods' service account is the JobConfig's, as a PyTorchJob's."""

    name: str = STOCK_RUNTIME
    kind: str = "ClusterTrainingRuntime"

    @classmethod
    def from_flags(cls, name: str | None, kind: str | None) -> "RuntimeRef":
        """From --runtime and --runtime-kind, either left out (None: the default)."""
        return cls(name or cls.name, kind or cls.kind)

    def validate(self) -> "RuntimeRef":
        if dns1123_problem("--runtime", self.name, subdomain=True):
            raise InvalidJobError(dns1123_problem("--runtime", self.name, subdomain=True) + ".")
        if self.kind not in RUNTIME_KINDS:
            raise InvalidJobError(f"--runtime-kind {self.kind!r} is not valid; choose one of: "
                                  f"{', '.join(RUNTIME_KINDS)}.")
        return self


def _check(cfg: JobConfig) -> None:
    """What a TrainJob cannot say (the runtime decides retries) or name (pod hostnames)."""
    defaults = JobConfig(name="", image="", train=cfg.train)
    for flag, attr, where in (("--restart-policy", "restart_policy", "failurePolicy"),
                              ("--backoff-limit", "backoff_limit", "failurePolicy.maxRestarts"),
                              ("--ttl", "ttl", "ttlSecondsAfterFinished")):
        if getattr(cfg, attr) != getattr(defaults, attr):
            raise InvalidJobError(
                f"{flag} does not apply to a TrainJob: the runtime's JobSet {where} decides it "
                f"(kfvision's runtime {KFVISION_RUNTIME}: exit codes 1-127 fail, 128+ restart "
                f"the nodes, at most {MAX_RESTARTS} times; manifests/trainer-v2/). Drop {flag}.")
    host = f"{cfg.name}-{NODE}-0-{cfg.nodes - 1}"
    if len(host) > 63:
        raise InvalidJobError(
            f"--name {cfg.name!r} is too long for {cfg.nodes} node(s): the JobSet names its pods' "
            f"hosts up to {host!r} ({len(host)} characters, limit 63). Use a name of at most "
            f"{63 - len(host) + len(cfg.name)} characters.")


def _patch(cfg: JobConfig) -> dict:
    """The runtimePatches entry: the pod settings of the PyTorchJob's pods that a TrainJob's
    `trainer` cannot carry (the schema allows only these pod and container fields)."""
    pod = pod_spec(cfg, NODE)
    (container,) = pod["containers"]
    spec = {"securityContext": pod["securityContext"]}
    for key in ("serviceAccountName", "nodeSelector", "tolerations"):
        if key in pod:
            spec[key] = pod[key]
    spec["volumes"] = pod["volumes"]
    spec["containers"] = [{"name": NODE, "securityContext": container["securityContext"],
                           "volumeMounts": container["volumeMounts"]}]
    labels = {**LABELS, **dict(sorted(cfg.labels))}
    template = {"metadata": {"labels": labels, "annotations": dict(ISTIO_OFF)}, "spec": spec}
    return {"manager": MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": NODE, "template": {"spec": {"template": template}}}]}}}}


def build_trainjob(cfg: JobConfig, runtime: RuntimeRef = RuntimeRef()) -> dict:
    """The TrainJob for `cfg` on `runtime` as a plain dict (no I/O; same config, same dict).

    Raises:
        InvalidJobError: the config breaks a rule of the cluster (name, P > G, quantities, or a
            PyTorchJob-only setting such as --restart-policy).
    """
    cfg.validate()
    cfg.train.validate()
    runtime.validate()
    _check(cfg)
    metadata = {"name": cfg.name}
    if cfg.namespace:
        metadata["namespace"] = cfg.namespace
    metadata["labels"] = {**LABELS, **dict(sorted(cfg.labels))}
    trainer = {"image": cfg.image, "command": command(cfg), "args": train_flags(cfg.train),
               # the Training Operator sets it, the torch plugin does not: logs as they happen
               "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}, *container_env(cfg)],
               "numNodes": cfg.nodes, "numProcPerNode": cfg.nproc}
    if asked := resources(cfg):
        trainer["resourcesPerNode"] = asked
    spec = {"runtimeRef": {"name": runtime.name, "apiGroup": API_GROUP, "kind": runtime.kind},
            "trainer": trainer}
    if cfg.active_deadline is not None:
        spec["activeDeadlineSeconds"] = cfg.active_deadline
    spec["runtimePatches"] = [_patch(cfg)]
    job = {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}
    return validate_trainjob(job, f"the rendered TrainJob {cfg.name!r}")


def set_command(job: dict, command, args, volumes=(), mounts=()) -> dict:
    """`job` with its trainer running `command` `args` instead of kfvision's trainer, `volumes`
    added to the nodes' pods and `mounts` to their container (through our runtimePatches entry);
    as kfvision.pipelines.jobs.pytorchjob.build.set_command."""
    job["spec"]["trainer"].update(command=list(command), args=list(args))
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    pod = patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["volumes"] += [dict(v) for v in volumes]
    pod["containers"][0]["volumeMounts"] += [dict(m) for m in mounts]
    return job


def build_runtime(image: str, kind: str = "ClusterTrainingRuntime",
                  name: str = KFVISION_RUNTIME, namespace: str | None = None,
                  max_restarts: int = MAX_RESTARTS) -> dict:
    """kfvision's torch runtime: the stock one plus the exit-code contract of docs/faults.md.

    A node's pod exiting 1-127 fails its Job through the Job's `podFailurePolicy` (reason
    PodFailurePolicy), and the JobSet rule `permanent` then fails the TrainJob. Any other failure
    fails the Job too (`backoffLimit: 0`: one node must not restart alone under a static
    rendezvous) and the rule `retry` recreates every node, which resume from the last
    checkpoint, at most `max_restarts` times. `podFailurePolicy` needs `restartPolicy: Never`.
    """
    metadata = {"name": name, **({"namespace": namespace} if namespace else {}),
                "labels": {FRAMEWORK_LABEL: "torch", **LABELS}}
    pod = {"restartPolicy": "Never",
           "automountServiceAccountToken": False,  # training pods never call the API
           "containers": [{"name": NODE, "image": image}]}
    job = {"backoffLimit": 0,
           "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
               "containerName": NODE, "operator": "In", "values": list(PERMANENT_CODES)}}]},
           "template": {"spec": pod}}
    failure = {"maxRestarts": max_restarts, "rules": [
        {"name": "permanent", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
        {"name": "retry", "action": "RestartJobSet"}]}
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": metadata, "spec": {
        "mlPolicy": {"numNodes": 1, "torch": {}},
        "template": {"spec": {"failurePolicy": failure, "replicatedJobs": [{
            "name": NODE,
            "template": {"metadata": {"labels": {ANCESTOR_LABEL: ANCESTOR_TRAINER}},
                         "spec": job}}]}}}}
