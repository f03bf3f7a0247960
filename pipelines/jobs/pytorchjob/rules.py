"""The Training Operator's validating-webhook rules for a PyTorchJob, checked before anything runs.

`kubectl apply` of a job that breaks one of these is refused by the webhook of Training Operator
v1.9.4 (`pkg/webhooks/pytorch/pytorchjob_webhook.go`; rules as listed in
../shared/reference/README.md). `kfvision job render` checks its own output with them, and
`run-local` / `submit` check the manifest they are given, so a job that runs locally is one the
cluster accepts.
"""

from kfvision.pipelines.clients.k8s import dns1035_problem
from kfvision.pipelines.jobs.errors import InvalidJobError

# The Training Operator's names, all from kubeflow/trainer tag v1.9.4 (docs/upstream.md lists
# them with their files): pkg/apis/kubeflow.org/v1/{groupversion_info,pytorch_types,common_types}.go
# (group, version, kind, plural, PyTorchJobDefaultContainerName, PyTorchJobDefaultPortName,
# PyTorchJobDefaultPort, replica types, restart policies, JobSucceeded), pkg/webhooks/pytorch/
# pytorchjob_webhook.go (managedBy), pkg/controller.v1/common/ (the pod labels).
GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "PyTorchJob"
CONTAINER_NAME = "pytorch"  # the operator finds the training container by this exact name
REPLICA_TYPES = ("Master", "Worker")
MANAGED_BY = ("kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue")
RESTART_POLICIES = ("ExitCode", "OnFailure", "Never", "Always")
PORT_NAME = "pytorchjob-port"  # the operator reads MASTER_PORT from the port with this name
DEFAULT_PORT = 23456  # the operator's default; written out so the manifest says what it uses
SUCCEEDED = "Succeeded"  # the condition type of a job that ended well
JOB_NAME_LABEL = "training.kubeflow.org/job-name"  # on every pod of the job
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"  # master / worker
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
JOB_ROLE_LABEL = "training.kubeflow.org/job-role"  # "master" on the Master's pod

def _replica_problems(rtype: str, spec) -> list:
    where = f"spec.pytorchReplicaSpecs.{rtype}"
    if not isinstance(spec, dict):
        return [f"{where} must be a mapping (replicas, restartPolicy, template)"]
    problems = []
    replicas = spec.get("replicas")
    if rtype == "Master" and replicas != 1:
        # The webhook validates before the controller defaults, so it must be written out.
        problems.append(f"{where}.replicas must be written out and equal 1 (found {replicas!r})")
    if rtype == "Worker" and replicas is not None and (
            not isinstance(replicas, int) or replicas < 1):
        problems.append(f"{where}.replicas must be >= 1 when set (found {replicas!r}); "
                        "leave the Worker spec out for a single-node job")
    policy = spec.get("restartPolicy")
    if policy is not None and policy not in RESTART_POLICIES:
        problems.append(f"{where}.restartPolicy {policy!r} is not one of "
                        f"{', '.join(RESTART_POLICIES)}")
    containers = (((spec.get("template") or {}).get("spec") or {}).get("containers")) or []
    if not containers:
        problems.append(f"{where}.template.spec.containers is empty: a replica needs a container")
    for i, c in enumerate(containers):
        if not (isinstance(c, dict) and c.get("image")):
            problems.append(f"{where}.template.spec.containers[{i}] has no image")
    if containers and not any(isinstance(c, dict) and c.get("name") == CONTAINER_NAME
                              for c in containers):
        problems.append(f"{where} has no container named exactly {CONTAINER_NAME!r} "
                        "(the operator injects the rendezvous environment into that one)")
    return problems


def webhook_problems(job) -> list:
    """Every webhook rule `job` (a PyTorchJob as a dict) breaks, as readable lines."""
    if not isinstance(job, dict):
        return ["the manifest is not a mapping: expected one PyTorchJob object"]
    problems = []
    if job.get("apiVersion") != API_VERSION or job.get("kind") != KIND:
        problems.append(f"apiVersion/kind are {job.get('apiVersion')!r}/{job.get('kind')!r}; "
                        f"expected {API_VERSION!r}/{KIND!r}")
    name_problem = dns1035_problem("metadata.name", (job.get("metadata") or {}).get("name"))
    if name_problem:
        problems.append(name_problem)
    spec = job.get("spec") or {}
    replicas = spec.get("pytorchReplicaSpecs")
    if not isinstance(replicas, dict) or not replicas:
        problems.append("spec.pytorchReplicaSpecs is required (Master and optionally Worker)")
        replicas = {}
    for rtype in replicas:
        if rtype not in REPLICA_TYPES:
            problems.append(f"spec.pytorchReplicaSpecs has {rtype!r}; only Master and Worker "
                            "are allowed")
    for rtype in REPLICA_TYPES:
        if rtype in replicas:
            problems += _replica_problems(rtype, replicas[rtype])
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in replicas:
            problems.append("spec.elasticPolicy needs a Worker replica spec")
        if (elastic or {}).get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            problems.append("spec.elasticPolicy.nProcPerNode is deprecated and may not be "
                            "combined with spec.nprocPerNode; keep spec.nprocPerNode only")
    managed_by = (spec.get("runPolicy") or {}).get("managedBy")
    if managed_by is not None and managed_by not in MANAGED_BY:
        problems.append(f"spec.runPolicy.managedBy {managed_by!r} is not one of "
                        f"{', '.join(MANAGED_BY)}")
    return problems


def validate_pytorchjob(job, source: str = "the manifest") -> dict:
    """Raise InvalidJobError listing every webhook rule `job` breaks; return `job` otherwise.

    Args:
        job: the PyTorchJob as a dict (e.g. from yaml.safe_load).
        source: where it came from, for the message (a file name).
    Raises:
        InvalidJobError: one or more rules are broken; the message lists all of them.
    """
    problems = webhook_problems(job)
    if problems:
        lines = "\n  - ".join(problems)
        raise InvalidJobError(f"{source} would be refused by the Training Operator's webhook:"
                              f"\n  - {lines}\nFix the manifest (or re-render it with "
                              "`kfvision job render`).")
    return job
