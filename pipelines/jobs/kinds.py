"""The two kinds of training job kfvision runs, side by side, and which one a cluster serves.

PyTorchJob (`kubeflow.org/v1`, Training Operator v1.9) and TrainJob (`trainer.kubeflow.org/
v1alpha1`, Kubeflow Trainer v2) differ, for the runners, in a handful of facts: where the API
serves them, how their pods are labelled and named, which container trains, which condition
means success. `JobKind` holds those facts once; the cluster client and the command line read
them from here instead of asking "which kind?" everywhere.
"""

from dataclasses import dataclass

from kfvision.pipelines.clients.k8s import Resource
from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.pytorchjob import rules as pytorchjob_rules
from kfvision.pipelines.jobs.trainjob import rules as trainjob_rules


@dataclass(frozen=True)
class JobKind(Resource):
    """What differs between the kinds, for submit / wait / logs / delete (where the API serves
    them and how to install them: `Resource`)."""

    pod_label: str = ""  # pod label whose value is the job's name
    container: str = ""  # the training container
    primary: str = ""  # the replica whose log is streamed (rank 0's pod)
    succeeded: str = ""  # the condition that ends the job well
    sets_env: str = ""  # who sets the launchers' variables in its pods (for the error that says so)

    def replica_name(self, pod: dict) -> str:
        """`master-0` / `worker-1` or `node-0-1` from the pod's labels (else the pod's name)."""
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if self is TRAINJOB:
            index = labels.get(trainjob_rules.COMPLETION_INDEX)
            rjob = labels.get(trainjob_rules.REPLICATED_JOB_LABEL)
            if index is not None and rjob is not None:
                return f"{rjob}-{labels.get(trainjob_rules.JOB_INDEX_LABEL, '0')}-{index}"
        else:
            rtype = labels.get(pytorchjob_rules.REPLICA_TYPE_LABEL)
            index = labels.get(pytorchjob_rules.REPLICA_INDEX_LABEL)
            if rtype is not None and index is not None:
                return f"{rtype.lower()}-{index}"
        return pod["metadata"]["name"]

    def pod_hosts(self, name: str, nodes: int) -> list:
        """The host names of job `name`'s pods, node 0 first, as its controller names them."""
        if self is TRAINJOB:
            return [f"{name}-{trainjob_rules.NODE}-0-{i}" for i in range(nodes)]
        return [f"{name}-master-0"] + [f"{name}-worker-{i}" for i in range(nodes - 1)]

    def node_index(self, pod: dict) -> int | None:
        """The pod's node index as torchrun numbers nodes (PyTorchJob: master-0 is 0, worker-i
        is i + 1; TrainJob: node-0-i is i), or None for a pod of another shape."""
        replica = self.replica_name(pod)
        kind, _, index = replica.rpartition("-")
        if not index.isdigit():
            return None
        if self is TRAINJOB:
            return int(index) if kind == f"{trainjob_rules.NODE}-0" else None
        return {"master": int(index), "worker": int(index) + 1}.get(kind)

    def shape(self, job: dict) -> tuple:
        """(nodes, processes per node as written: a number or `auto`) of a job's manifest; a
        TrainJob without numNodes has its runtime's (1 for the runtimes kfvision renders)."""
        spec = job.get("spec") or {}
        if self is TRAINJOB:
            trainer = spec.get("trainer") or {}
            return int(trainer.get("numNodes") or 1), str(trainer.get("numProcPerNode") or "auto")
        replicas = spec.get("pytorchReplicaSpecs") or {}
        nodes = sum(1 if r.get("replicas") is None else int(r["replicas"])
                    for r in replicas.values())
        return nodes, str(spec.get("nprocPerNode") or "auto")

    def trainer_env(self, job: dict) -> dict:
        """{name: value} of the plain `env` of rank 0's training container in a manifest."""
        spec = job.get("spec") or {}
        if self is TRAINJOB:
            items = (spec.get("trainer") or {}).get("env") or []
        else:
            pod = (((spec.get("pytorchReplicaSpecs") or {}).get("Master") or {}).get("template")
                   or {}).get("spec") or {}
            items = next((c.get("env") or [] for c in pod.get("containers") or []
                          if c.get("name") == self.container), [])
        return {e["name"]: str(e["value"]) for e in items if "value" in e}


PYTORCHJOB = JobKind(
    kind=pytorchjob_rules.KIND, group=pytorchjob_rules.GROUP, version=pytorchjob_rules.VERSION,
    plural=pytorchjob_rules.PLURAL,
    install="install the Kubeflow Training Operator v1.9 (kubectl apply --server-side -k "
    "\"github.com/kubeflow/trainer.git/manifests/overlays/standalone?ref=v1.9.4\")",
    pod_label=pytorchjob_rules.JOB_NAME_LABEL, container=pytorchjob_rules.CONTAINER_NAME,
    primary="master-0", succeeded=pytorchjob_rules.SUCCEEDED,
    sets_env="the Training Operator sets it")
TRAINJOB = JobKind(
    kind=trainjob_rules.KIND, group=trainjob_rules.API_GROUP, version=trainjob_rules.VERSION,
    plural=trainjob_rules.PLURAL,
    install="install Kubeflow Trainer v2 (see https://www.kubeflow.org/docs/components/trainer/"
    "operator-guides/installation/)",
    pod_label=trainjob_rules.JOBSET_NAME_LABEL, container=trainjob_rules.NODE,
    primary=f"{trainjob_rules.NODE}-0-0", succeeded=trainjob_rules.COMPLETE,
    sets_env=f"Kubeflow Trainer's webhook refuses {', '.join(trainjob_rules.PET_NAMES)} in "
    "trainer.env")
KINDS = {k.kind: k for k in (TRAINJOB, PYTORCHJOB)}  # preference order: TrainJob first


def named(flag: str) -> JobKind:
    """The JobKind of a `--kind` / job_kind value (`pytorchjob`, `trainjob`)."""
    return next(k for k in KINDS.values() if k.kind.lower() == flag)


def kind_of(job: dict, source: str = "the manifest") -> JobKind:
    """The JobKind of a manifest dict (by apiVersion and kind)."""
    kind = KINDS.get(job.get("kind")) if isinstance(job, dict) else None
    if kind is None or job.get("apiVersion") != f"{kind.group}/{kind.version}":
        found = (job.get("apiVersion"), job.get("kind")) if isinstance(job, dict) else job
        raise InvalidJobError(f"{source} is {found!r}, not a job kfvision runs: expected a "
                              f"kubeflow.org/v1 PyTorchJob or a {trainjob_rules.API_VERSION} "
                              "TrainJob (as `kfvision job render [--kind trainjob]` writes).")
    return kind


def read_job(path) -> dict:
    """The one PyTorchJob or TrainJob in the YAML file `path` ("-": standard input), checked
    against its kind's rules.

    Raises:
        InvalidJobError: unreadable file, not YAML, not exactly one job, or a broken rule; a
            file that also holds ConfigMaps (a user's script: read_manifest).
    """
    job, config_maps = read_manifest(path)
    if config_maps:
        raise InvalidJobError(f"{path} also holds ConfigMap(s) {', '.join(config_maps)}: use "
                              "`kfvision job run-local` or `submit`, which create them too.")
    return job


def read_manifest(path) -> tuple:
    """(the one PyTorchJob or TrainJob, {name: ConfigMap}) of the YAML file `path` ("-":
    standard input): a job as `kfvision job render` writes it, with the ConfigMaps that carry a
    user's source (`render --source`, written before the job).

    Raises:
        InvalidJobError: unreadable file, not YAML, not exactly one job, another kind of
            object, or a broken rule.
    """
    import sys
    from pathlib import Path

    import yaml

    source = "standard input" if str(path) == "-" else str(path)
    try:
        text = sys.stdin.read() if str(path) == "-" else Path(path).read_text(encoding="utf-8")
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        raise InvalidJobError(f"cannot read the job manifest {source}: {e}") from e
    config_maps = {}
    for d in docs:
        if isinstance(d, dict) and d.get("apiVersion") == "v1" and d.get("kind") == "ConfigMap":
            name = (d.get("metadata") or {}).get("name")
            if not name:
                raise InvalidJobError(f"{source}: a ConfigMap without metadata.name.")
            config_maps[name] = d
    jobs = [d for d in docs if not (isinstance(d, dict) and d.get("kind") == "ConfigMap")]
    if len(jobs) != 1:
        raise InvalidJobError(f"{source} holds {len(jobs)} job documents; expected exactly one "
                              "PyTorchJob or TrainJob (as `kfvision job render` writes), "
                              "optionally after the ConfigMaps of its source.")
    if kind_of(jobs[0], source) is TRAINJOB:
        return trainjob_rules.validate_trainjob(jobs[0], source), config_maps
    return pytorchjob_rules.validate_pytorchjob(jobs[0], source), config_maps


def served_kinds(api) -> list:
    """The JobKinds whose CRD the API server serves, TrainJob first (API discovery).

    Args:
        api: a kfvision.pipelines.clients.k8s.Api.
    Raises:
        KubernetesError, EndpointError: discovery itself failed.
    """
    return [kind for kind in KINDS.values() if kind.plural in api.served(kind.group, kind.version)]


def pick_kind(api) -> JobKind:
    """The kind to run on this cluster: TrainJob when its CRD is served, else PyTorchJob.

    Raises:
        InvalidJobError: neither CRD is served; the message names both and how to install them.
    """
    served = served_kinds(api)
    if not served:
        raise InvalidJobError(
            f"the cluster serves neither {TRAINJOB.crd} (Kubeflow Trainer v2, TrainJob) nor "
            f"{PYTORCHJOB.crd} (Training Operator v1.9, PyTorchJob), so kfvision cannot train "
            f"there. To fix it, {TRAINJOB.install}; or {PYTORCHJOB.install}.")
    return served[0]
