"""The PyTorchJob (`kubeflow.org/v1`, Training Operator v1.9) of a training run: a pure function of
a JobConfig (pipelines/jobs/config.py).

    job = build_pytorchjob(JobConfig(name="digits", image="...", train=train_config, nodes=2,
                                     procs_per_node=4, gpus_per_node=4))
    print(to_yaml(job))

`Master` (1 replica) plus `Worker` (nodes - 1), container `pytorch`, `nprocPerNode` processes per
pod; the operator injects the `PET_*` variables torchrun reads (pipelines/jobs/pytorchjob/rules.py
has the operator's names).
"""

from kfvision.pipelines.jobs.config import LABELS, JobConfig, pod_spec
from kfvision.pipelines.jobs.pytorchjob.rules import (
    API_VERSION,
    CONTAINER_NAME,
    DEFAULT_PORT,
    KIND,
    PORT_NAME,
    validate_pytorchjob,
)

PORTS = ({"name": PORT_NAME, "containerPort": DEFAULT_PORT, "protocol": "TCP"},)


def _replica(cfg: JobConfig, replicas: int) -> dict:
    labels = {**LABELS, **dict(sorted(cfg.labels))}
    return {
        "replicas": replicas,
        "restartPolicy": cfg.restart_policy,
        "template": {
            "metadata": {"labels": labels,
                         # Istio sidecars keep finished pods alive and can block rendezvous.
                         "annotations": {"sidecar.istio.io/inject": "false"}},
            "spec": pod_spec(cfg, CONTAINER_NAME, PORTS),
        },
    }


def build_pytorchjob(cfg: JobConfig) -> dict:
    """The PyTorchJob for `cfg` as a plain dict (no I/O; same config, same dict).

    Raises:
        InvalidJobError: the config breaks a rule of the cluster (name, P > G, quantities, ...).
    """
    cfg.validate()
    cfg.train.validate()
    metadata = {"name": cfg.name}
    if cfg.namespace:
        metadata["namespace"] = cfg.namespace
    metadata["labels"] = {**LABELS, **dict(sorted(cfg.labels))}
    run_policy = {"backoffLimit": cfg.backoff_limit,
                  # a failed job's stuck pods would hold their GPUs until someone deletes them
                  "cleanPodPolicy": "Running"}
    if cfg.active_deadline is not None:
        run_policy["activeDeadlineSeconds"] = cfg.active_deadline
    if cfg.ttl is not None:
        run_policy["ttlSecondsAfterFinished"] = cfg.ttl
    replica_specs = {"Master": _replica(cfg, 1)}
    if cfg.nodes > 1:
        replica_specs["Worker"] = _replica(cfg, cfg.nodes - 1)
    job = {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata,
           "spec": {"nprocPerNode": str(cfg.nproc), "runPolicy": run_policy,
                    "pytorchReplicaSpecs": replica_specs}}
    return validate_pytorchjob(job, f"the rendered job {cfg.name!r}")


def set_command(job: dict, command, args, volumes=(), mounts=()) -> dict:
    """`job` with every replica's container running `command` `args` instead of the trainer,
    `volumes` added to the pods and `mounts` to that container (a user's script's job:
    pipelines/script/manifest.py). Not validated again: the caller does, once it is complete."""
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        container = pod["containers"][0]
        container.update(command=list(command), args=list(args))
        container["volumeMounts"] += [dict(m) for m in mounts]
        pod["volumes"] += [dict(v) for v in volumes]
    return job
