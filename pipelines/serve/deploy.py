"""The KServe InferenceService (`serving.kserve.io/v1beta1`) that serves a trained model.

A pure function of its config (`DeployConfig` in, dict out). The predictor is a custom container:
the kfvision image running `kfvision serve` on the model KServe's storage initializer fetches from
`STORAGE_URI` (pvc://, s3://, gs://, https://) into /mnt/models. Readiness is the v2 health
endpoint; the pod runs as the image's non-root user with a read-only root filesystem; Prometheus
scrapes its /metrics.
"""

import re
from dataclasses import dataclass

from kfvision.pipelines.clients.cluster import namespace_option
from kfvision.pipelines.clients.k8s import GPU_RESOURCE, dns1123_problem, quantity
from kfvision.pipelines.jobs.home import home_env, home_mount, home_volume
from kfvision.pipelines.serve.server import ServeOptions
from kfvision.trainer.errors import InvalidParameterError
from kfvision.trainer.options import check_options, option, ref_of

API_VERSION = "serving.kserve.io/v1beta1"
KIND = "InferenceService"
CONTAINER_NAME = "kserve-container"  # the name KServe expects for a custom predictor
MODEL_MOUNT = "/mnt/models"  # where the storage initializer puts STORAGE_URI's contents
PORT = 8080
READY_PATH = "/v2/health/ready"
# KServe v0.20.0 pkg/apis/serving/v1beta1/inference_service_status.go: the Ready condition, and
# status.modelStatus.states.activeModelState (Pending, Standby, Loading, Loaded, FailedToLoad)
READY_CONDITION = "Ready"
MODEL_LOADED, MODEL_FAILED = "Loaded", "FailedToLoad"
# Prometheus scrapes the container's own /metrics (KServe's Python server, kfvision's metrics
# beside it) through the pod annotations prometheus.io/scrape|port|path. KServe v0.20.0
# pkg/webhook/admission/pod/metrics_aggregate_injector.go: with SetPrometheusAnnotation "true"
# (pkg/constants/constants.go; also the cluster's default when unset) the pod webhook points
# prometheus.io/port at Knative's queue-proxy (9091, or 9088 aggregating), which the Standard
# mode does not have; "false" leaves our port in both modes.
PROMETHEUS_SCRAPING = "serving.kserve.io/enable-prometheus-scraping"
METRICS_PATH = "/metrics"  # kserve 0.21 kserve/protocol/rest/server.py
# KServe v0.20.0 pkg/apis/serving/v1beta1/component.go (ComponentExtensionSpec's
# ContainerConcurrency): the requests one replica is given at once, Knative's hard limit (its
# autoscaler aims at a share of it)
CONTAINER_CONCURRENCY = "containerConcurrency"
RUN_AS = 1000  # the image's user (images/Dockerfile: USER 1000:1000)
# model-registry://[HOST/]NAME[/VERSION]: Kubeflow Model Registry's storage initializer resolves it
STORAGE_SCHEMES = ("pvc://", "s3://", "gs://", "https://", "http://", "hdfs://", "webhdfs://",
                   "model-registry://")
# DNS-1035 label: the InferenceService name becomes a Service (and a host name)
NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
NAME_MAX = 63


@dataclass(frozen=True)
class DeployConfig:
    """What `kfvision deploy render` takes. Its options are declared once, here: the flags (and
    the names errors give them, the pipeline's where `pipeline` says) come from these fields."""

    name: str = option(help="InferenceService name (and the served model's name)", doc="Lower-"
                       "case letters, digits and '-', starting with a letter.",
                       pipeline="deploy_name")
    model: str = option(help="storage URI of the trained model directory", doc="pvc://CLAIM/"
                        "path, s3://..., gs://... (mounted at /mnt/models), model-registry://"
                        "NAME/VERSION (Kubeflow Model Registry), or models:/NAME/VERSION (MLflow: "
                        "its version's storage URI).")
    image: str = option(help="the kfvision image (images/Dockerfile)", pipeline=True)
    namespace: str | None = namespace_option("kubectl's")
    gpus: int = option(0, "GPUs per replica", low=0, high=16)
    min_replicas: int = option(1, "replicas at least (0: scale to zero, serverless mode)", low=0,
                               high=1000)
    max_replicas: int = option(1, "replicas at most (at least --min-replicas)", low=1,
                               high=1000)
    cpu: str = option("1", "CPU request per replica (cores or millicores)", doc="`kfvision "
                      "serve` sizes its threads from it, rounded up.")
    memory: str = option("2Gi", "memory request and limit per replica")
    max_batch_size: int | None = option(None, "passed to `kfvision serve`",
                                        unset="kfvision serve's")
    batch_wait_ms: float | None = option(None, "passed to `kfvision serve`",
                                         unset="kfvision serve's")
    max_queue: int | None = option(None, "passed to `kfvision serve`; sets containerConcurrency",
                                   low=1, high=1_000_000, unset="half the batch size",
                                   doc="Written out, not measured by the pod: KServe's "
                                   "autoscaler must know the bound before the pod runs. The "
                                   "predictor's "
                                   "containerConcurrency is the one-image requests a replica "
                                   "holds: those waiting, and a pass of at most as many.")
    service_account: str | None = option(
        None, "ServiceAccount the predictor runs as", doc="For an s3:// model: the one KServe's "
        "storage initializer takes the S3 credentials from (a Secret attached to it, with "
        "KServe's s3-endpoint annotations, or an IRSA role): docs/serving.md.",
        unset="the namespace's default", metavar="NAME", pipeline="deploy_service_account")

    def check(self) -> "DeployConfig":
        """Raise InvalidParameterError naming the first bad field; returns self."""
        name, model = ref_of(DeployConfig, "name"), ref_of(DeployConfig, "model")
        if not NAME.match(self.name) or len(self.name) > NAME_MAX:
            raise InvalidParameterError(
                f"{name} = {self.name!r} is not valid: an InferenceService name is lower-case "
                f"letters, digits and '-', starts with a letter, at most {NAME_MAX} characters.")
        if not self.model.startswith(STORAGE_SCHEMES) or self.model.endswith("://"):
            raise InvalidParameterError(
                f"{model} = {self.model!r} is not a storage URI KServe can fetch; use one of "
                f"{', '.join(s + '...' for s in STORAGE_SCHEMES)} (e.g. pvc://CLAIM/models/r18).")
        if self.model.startswith("pvc://") and not self.model[len("pvc://"):].split("/")[0]:
            raise InvalidParameterError(f"{model} = {self.model!r} names no claim: "
                                        "pvc://CLAIM/path")
        problem = self.service_account is not None and dns1123_problem(
            ref_of(DeployConfig, "service_account"), self.service_account, subdomain=True)
        if problem:
            raise InvalidParameterError(problem + ".")
        if not self.image:
            raise InvalidParameterError(f"{ref_of(DeployConfig, 'image')} is empty: give the "
                                        "kfvision image to run")
        try:
            cores = quantity(self.cpu)
        except ValueError:
            cores = 0
        if cores < 1:
            raise InvalidParameterError(
                f"{ref_of(DeployConfig, 'cpu')} = {self.cpu!r} is not a CPU request kfvision "
                "serve can size its threads from: give cores ('1', '2.5') or millicores "
                "('500m').")
        check_options(self)  # ranges, as declared
        if self.max_replicas < self.min_replicas:
            low, high = ref_of(DeployConfig, "min_replicas"), ref_of(DeployConfig, "max_replicas")
            raise InvalidParameterError(
                f"{high} = {self.max_replicas} is below {low} = {self.min_replicas}; give "
                f"{high} {self.min_replicas} or more.")
        return self


def max_queue(cfg: DeployConfig) -> int:
    """The --max-queue the pod serves with: as given, else half a batch (kfvision serve's least,
    and what it picks for a CPU replica's model)."""
    return cfg.max_queue or max(1, (cfg.max_batch_size or ServeOptions.max_batch_size) // 2)


def container_concurrency(cfg: DeployConfig) -> int:
    """One-image requests a replica holds at once: those waiting, and the pass under way (which
    takes only what waited, at most a batch)."""
    batch = cfg.max_batch_size or ServeOptions.max_batch_size
    return max_queue(cfg) + min(max_queue(cfg), batch)


def serve_args(cfg: DeployConfig) -> list[str]:
    """The container's arguments: `kfvision serve` on the mounted model."""
    # Threads from the CPU request: the pod has no CPU limit, so the server would otherwise count
    # the node's cores, and an OpenMP team that wide on a busy node stalls at every barrier.
    cores = str(quantity(cfg.cpu))
    args = ["serve", "--model", MODEL_MOUNT, "--name", cfg.name, "--http-port", str(PORT),
            "--model-threads", cores, "--workers", cores]
    if cfg.gpus:
        args += ["--device", "cuda"]
    if cfg.max_batch_size is not None:
        args += ["--max-batch-size", str(cfg.max_batch_size)]
    if cfg.batch_wait_ms is not None:
        args += ["--batch-wait-ms", f"{cfg.batch_wait_ms:g}"]
    return args + ["--max-queue", str(max_queue(cfg))]


def _container(cfg: DeployConfig) -> dict:
    limits = {"memory": cfg.memory, **({GPU_RESOURCE: str(cfg.gpus)} if cfg.gpus else {})}
    return {
        "name": CONTAINER_NAME,
        "image": cfg.image,
        "command": ["kfvision"],
        "args": serve_args(cfg),
        "env": [{"name": "STORAGE_URI", "value": cfg.model}, *home_env()],
        "ports": [{"containerPort": PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": READY_PATH, "port": PORT},
                           "initialDelaySeconds": 5, "periodSeconds": 10,
                           "failureThreshold": 3},
        "resources": {"requests": {"cpu": cfg.cpu, "memory": cfg.memory}, "limits": limits},
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]},
                            "readOnlyRootFilesystem": True},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, home_mount()],
    }


def build_inference_service(cfg: DeployConfig) -> dict:
    """The InferenceService manifest (a plain dict, ready for YAML or the Kubernetes API)."""
    cfg.check()
    metadata = {"name": cfg.name, "labels": {"app.kubernetes.io/name": "kfvision",
                                             "app.kubernetes.io/component": "predictor"}}
    metadata["annotations"] = {PROMETHEUS_SCRAPING: "false", "prometheus.io/scrape": "true",
                               "prometheus.io/port": str(PORT),
                               "prometheus.io/path": METRICS_PATH}
    if cfg.namespace:
        metadata["namespace"] = cfg.namespace
    predictor = {
        "minReplicas": cfg.min_replicas,
        "maxReplicas": cfg.max_replicas,
        CONTAINER_CONCURRENCY: container_concurrency(cfg),
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS,
                            "fsGroup": RUN_AS, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [_container(cfg)],
        "volumes": [{"name": "tmp", "emptyDir": {}}, home_volume()],
    }
    if cfg.service_account:
        predictor["serviceAccountName"] = cfg.service_account
    if cfg.gpus:
        predictor["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists",
                                     "effect": "NoSchedule"}]
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata,
            "spec": {"predictor": predictor}}
