"""What Kubeflow Trainer v2.3.0 refuses in a TrainJob, checked before anything runs.

A TrainJob is checked twice by the API server: the CRD's CEL rules (`x-kubernetes-validations`;
the ones that need no old object are the name's format and length) and the trainer's validating
webhook (`pkg/webhooks/trainjob_webhook.go` -> the jobset and torch plugins), whose rules are
listed in ../shared/reference/README.md ("Kubeflow Trainer v2"). `kfvision job render --kind
trainjob` checks its own output here, and `run-local` / `submit` check the manifest they are given.
"""

import re

from kfvision.pipelines.clients.k8s import dns1123_problem
from kfvision.pipelines.jobs.errors import InvalidJobError

# Kubeflow Trainer's names, all from kubeflow/trainer tag v2.3.0 (docs/upstream.md lists them
# with their files): pkg/apis/trainer/v1alpha1/ (group, version, kinds, conditions),
# pkg/constants/constants.go (Node, ContainerTrainerPort, TorchEnv*, LabelTrainJobAncestor,
# AncestorTrainer), manifests/base/runtimes/torch_distributed.yaml (the stock runtime and its
# framework label); the pod labels are JobSet v0.12.0's (the JobSet Trainer v2.3.0 installs) and
# batch/v1's. The status variables the trainer reads are in trainer/upstream.py.
API_GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
API_VERSION = f"{API_GROUP}/{VERSION}"
KIND = "TrainJob"
RUNTIME_KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")
NODE = "node"  # the torch plugin's replicated job and container (pkg/constants)
MASTER_PORT = 29500  # the torch plugin's PET_MASTER_PORT (and the container port it adds)
COMPLETE = "Complete"  # the condition type of a job that ended well
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"  # on a runtime's replicated job
ANCESTOR_TRAINER = "trainer"  # ... of the trainer's pods: where the plugins inject
FRAMEWORK_LABEL = "trainer.kubeflow.org/framework"  # "torch" on torch runtimes
STOCK_RUNTIME = "torch-distributed"
STOCK_IMAGE = "pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"  # = the TrainJob's name, on its pods
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # label and annotation: node rank
# What the torch plugin injects into container `node`; trainer.env may not set them.
PET_NAMES = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",  # this order
             "PET_MASTER_PORT")
PET_PREFIX = "PET_"  # torchrun reads every PET_<FLAG> as its flag's default
NO_ENV_PATCH = (NODE, "dataset-initializer", "model-initializer")  # env goes in trainer.env
MANAGED_BY = ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue")
# The stock torch-distributed runtime's shape: replicated job -> its containers.
TORCH_JOBS = {NODE: (NODE,)}
_CEL_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # the CRD's rule, verbatim
_PATH = re.compile(r"[A-Za-z0-9/\-._~%!$&'()*+,;=:]+")  # Kubernetes' IsDomainPrefixedPath


def cel_problems(job: dict) -> list:
    """The TrainJob CRD's CEL rules checkable without the cluster (the name's format, length)."""
    name = (job.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not _CEL_NAME.match(name):
        return [f"metadata.name {name!r} must match RFC 1035 DNS label format "
                "(lower-case letters, digits and '-', starting with a letter)"]
    if len(name) > 63:
        return [f"metadata.name {name!r} must be no more than 63 characters"]
    return []


def manager_problem(manager) -> str | None:
    """Why `manager` is not a domain-prefixed path such as `example.com/tool`, or None."""
    domain, sep, path = str(manager).partition("/")
    if (not isinstance(manager, str) or not sep or dns1123_problem("", domain, subdomain=True)
            or not _PATH.fullmatch(path)):
        return (f"runtimePatches[].manager {manager!r} is not a domain-prefixed path "
                "(e.g. example.com/tool)")
    return None


def runtime_jobs(runtime: dict) -> dict:
    """{replicated job: (container names...)} of a (Cluster)TrainingRuntime dict."""
    jobs = ((runtime.get("spec") or {}).get("template") or {}).get("spec", {}).get(
        "replicatedJobs") or []
    return {j["name"]: tuple(c["name"] for c in _pod(j).get("containers") or [])
            for j in jobs}


def _pod(replicated_job: dict) -> dict:
    return ((((replicated_job.get("template") or {}).get("spec") or {}).get("template") or {})
            .get("spec") or {})


def _patch_problems(patches, jobs: dict) -> list:
    problems, seen = [], set()
    for i, patch in enumerate(patches or []):
        where = f"spec.runtimePatches[{i}]"
        problem = manager_problem(patch.get("manager"))
        if problem:
            problems.append(problem)
        if patch.get("manager") in seen:
            problems.append(f"{where}.manager {patch.get('manager')!r} is used twice")
        seen.add(patch.get("manager"))
        spec = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}
        for rjob in spec.get("replicatedJobs") or []:
            name = rjob.get("name")
            if name not in jobs:
                problems.append(f"{where} patches replicated job {name!r}, which the runtime "
                                f"does not have (it has: {', '.join(jobs)})")
                continue
            pod = _pod(rjob)
            for c in [*pod.get("containers", []), *pod.get("initContainers", [])]:
                if c.get("name") not in jobs[name]:
                    problems.append(f"{where} patches container {c.get('name')!r} of {name!r}, "
                                    f"which has only {', '.join(jobs[name]) or 'none'}")
                if c.get("env") and c.get("name") in NO_ENV_PATCH:
                    problems.append(f"{where} sets env of container {c['name']!r}: use "
                                    "spec.trainer.env (or the initializer's env) instead")
    return problems


def webhook_problems(job, jobs: dict | None = None) -> list:
    """Every CEL and webhook rule `job` (a TrainJob dict) breaks, as readable lines.

    `jobs`: the referenced runtime's {replicated job: containers} (default: the torch runtime's,
    one job `node` with one container `node`, as both the stock and kfvision's runtimes have).
    """
    if not isinstance(job, dict):
        return ["the manifest is not a mapping: expected one TrainJob object"]
    problems = []
    if job.get("apiVersion") != API_VERSION or job.get("kind") != KIND:
        problems.append(f"apiVersion/kind are {job.get('apiVersion')!r}/{job.get('kind')!r}; "
                        f"expected {API_VERSION!r}/{KIND!r}")
    problems += cel_problems(job)
    spec = job.get("spec") or {}
    ref = spec.get("runtimeRef") or {}
    if not ref.get("name"):
        problems.append("spec.runtimeRef.name is required (e.g. torch-distributed)")
    if ref.get("kind", RUNTIME_KINDS[0]) not in RUNTIME_KINDS:
        problems.append(f"spec.runtimeRef.kind {ref.get('kind')!r} is not one of "
                        f"{', '.join(RUNTIME_KINDS)}")
    if ref.get("apiGroup", API_GROUP) != API_GROUP:
        problems.append(f"spec.runtimeRef.apiGroup {ref.get('apiGroup')!r} is not {API_GROUP}")
    env = [e.get("name") for e in (spec.get("trainer") or {}).get("env") or []]
    for name in sorted(set(env) & set(PET_NAMES)):
        problems.append(f"spec.trainer.env sets {name}, which the torch plugin injects itself")
    problems += _patch_problems(spec.get("runtimePatches"), jobs or TORCH_JOBS)
    managed_by = spec.get("managedBy")
    if managed_by is not None and managed_by not in MANAGED_BY:
        problems.append(f"spec.managedBy {managed_by!r} is not one of {', '.join(MANAGED_BY)}")
    return problems


def validate_trainjob(job, source: str = "the manifest", jobs: dict | None = None) -> dict:
    """Raise InvalidJobError listing every rule `job` breaks; return `job` otherwise.

    Raises:
        InvalidJobError: one or more rules are broken; the message lists all of them.
    """
    problems = webhook_problems(job, jobs)
    if problems:
        lines = "\n  - ".join(problems)
        raise InvalidJobError(f"{source} would be refused by Kubeflow Trainer (CRD rules and "
                              f"webhook):\n  - {lines}\nFix the manifest (or re-render it with "
                              "`kfvision job render --kind trainjob`).")
    return job
