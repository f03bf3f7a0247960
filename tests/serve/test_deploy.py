"""kfvision deploy render: the InferenceService, checked against KServe's typed models (every field
must be one the v1beta1 API has, with the right type) and Kubernetes' own schema for the pod parts.

What cannot be checked here: KServe's admission webhooks and controller (no cluster), that the
storage initializer can fetch the URI, and that the image runs (no container engine).
"""

import io

import kubernetes.client
import kubernetes_validate
import pytest
import yaml

from kfvision.pipelines.cli import main
from kfvision.pipelines.serve.deploy import (
    CONTAINER_NAME,
    MODEL_MOUNT,
    READY_PATH,
    DeployConfig,
    build_inference_service,
)
from kfvision.trainer.errors import InvalidParameterError

K8S_VERSION = "1.30"  # the kubernetes client we pin is 30.x
BASE = {"name": "digits", "model": "pvc://kfvision-data/models/digits", "image": "img:0.1"}
CONFIGS = {
    "cpu": {},
    "gpu": {"gpus": 2, "namespace": "team-a", "min_replicas": 2, "max_replicas": 5},
    "s3 scale to zero": {"model": "s3://bucket/models/digits", "min_replicas": 0,
                         "max_batch_size": 16, "batch_wait_ms": 2.5},
}


def _kserve_models():
    import kserve.models

    return kserve.models


def typed_problems(value, type_name: str, where: str = "") -> list[str]:
    """Fields of `value` that the typed model `type_name` (KServe's or Kubernetes' generated
    OpenAPI classes: openapi_types + attribute_map) does not have, or of the wrong type."""
    if type_name.startswith("list["):
        if not isinstance(value, list):
            return [f"{where}: not a list"]
        return [p for i, v in enumerate(value)
                for p in typed_problems(v, type_name[5:-1], f"{where}[{i}]")]
    if type_name.startswith("dict("):
        if not isinstance(value, dict):
            return [f"{where}: not a map"]
        inner = type_name[5:-1].split(", ", 1)[1]
        return [p for k, v in value.items() for p in typed_problems(v, inner, f"{where}.{k}")]
    simple = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}
    if type_name in simple:
        ok = isinstance(value, simple[type_name]) and not (
            type_name == "int" and isinstance(value, bool))
        return [] if ok else [f"{where}: {value!r} is not {type_name}"]
    cls = getattr(_kserve_models(), type_name, None) or getattr(kubernetes.client, type_name)
    if not isinstance(value, dict):
        return [f"{where}: not an object ({type_name})"]
    by_json = {j: py for py, j in cls.attribute_map.items()}
    problems = []
    for key, v in value.items():
        if key not in by_json:
            problems.append(f"{where}.{key}: not a field of {type_name}")
        else:
            problems += typed_problems(v, cls.openapi_types[by_json[key]], f"{where}.{key}")
    return problems


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fields_are_kserve_v1beta1_inference_service_fields(config):
    isvc = build_inference_service(DeployConfig(**{**BASE, **CONFIGS[config]}))
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    assert isvc["kind"] == "InferenceService"
    assert typed_problems(isvc, "V1beta1InferenceService") == []


def test_the_checker_finds_an_unknown_field_and_a_wrong_type():
    isvc = build_inference_service(DeployConfig(**BASE))
    isvc["spec"]["predictor"]["minReplica"] = 1
    isvc["spec"]["predictor"]["containers"][0]["ports"][0]["containerPort"] = "8080"
    assert typed_problems(isvc, "V1beta1InferenceService") == [
        ".spec.predictor.containers[0].ports[0].containerPort: '8080' is not int",
        ".spec.predictor.minReplica: not a field of V1beta1PredictorSpec"]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_pod_parts_pass_kubernetes_own_schema(config):
    predictor = build_inference_service(DeployConfig(**{**BASE, **CONFIGS[config]})
                                        )["spec"]["predictor"]
    pod = {k: v for k, v in predictor.items()
           if k not in ("minReplicas", "maxReplicas", "containerConcurrency")}  # KServe's
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                  "metadata": {"name": "t"}, "template": {"spec": pod}},
                                 K8S_VERSION, strict=True)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_prometheus_scrapes_the_containers_own_metrics(config):
    meta = build_inference_service(DeployConfig(**{**BASE, **CONFIGS[config]}))["metadata"]
    assert meta["annotations"] == {"serving.kserve.io/enable-prometheus-scraping": "false",
                                   "prometheus.io/scrape": "true", "prometheus.io/port": "8080",
                                   "prometheus.io/path": "/metrics"}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_predictor_runs_kfvision_serve_on_the_mounted_model(config):
    cfg = DeployConfig(**{**BASE, **CONFIGS[config]})
    predictor = build_inference_service(cfg)["spec"]["predictor"]
    (c,) = predictor["containers"]
    assert c["name"] == CONTAINER_NAME
    assert c["command"] == ["kfvision"] and c["args"][:5] == ["serve", "--model", MODEL_MOUNT,
                                                              "--name", cfg.name]
    assert {"name": "STORAGE_URI", "value": cfg.model} in c["env"]
    assert c["readinessProbe"]["httpGet"] == {"path": READY_PATH, "port": 8080}
    assert predictor["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert ("--device" in c["args"]) == bool(cfg.gpus)
    assert c["resources"]["limits"].get("nvidia.com/gpu") == (str(cfg.gpus) if cfg.gpus
                                                              else None)
    assert (predictor["minReplicas"], predictor["maxReplicas"]) == (cfg.min_replicas,
                                                                    cfg.max_replicas)


@pytest.mark.parametrize("cpu, threads", [("1", "1"), ("500m", "1"), ("2.5", "3"), ("4", "4"),
                                          ("1500m", "2")])
def test_server_threads_follow_the_cpu_request_not_the_nodes_cores(cpu, threads):
    """The predictor has a CPU request and no limit: inside, every core of the node is visible."""
    c = build_inference_service(DeployConfig(**{**BASE, "cpu": cpu}))["spec"]["predictor"][
        "containers"][0]
    args = dict(zip(c["args"][1::2], c["args"][2::2]))
    assert args["--model-threads"] == args["--workers"] == threads
    assert c["resources"]["requests"]["cpu"] == cpu


@pytest.mark.parametrize("change, words", [
    ({"name": "Digits"}, "lower-case"),
    ({"name": "9digits"}, "starts with a letter"),
    ({"name": "d" * 64}, "at most 63"),
    ({"model": "/data/models/r18"}, "storage URI"),
    ({"model": "pvc:///models"}, "names no claim"),
    ({"model": "s3://"}, "storage URI"),
    ({"image": ""}, "image is empty"),
    ({"gpus": -1}, "gpus"),
    ({"min_replicas": 3, "max_replicas": 2}, "max-replicas"),
    ({"cpu": "two"}, "cpu = 'two' is not a CPU request"),
    ({"cpu": "0"}, "millicores"),
])
def test_bad_config_is_refused_naming_the_field(change, words):
    with pytest.raises(InvalidParameterError, match=words):
        build_inference_service(DeployConfig(**{**BASE, **change}))


def test_cli_render_writes_the_same_manifest(tmp_path, capsys):
    out = tmp_path / "isvc.yaml"
    assert main(["deploy", "render", "--model", BASE["model"], "--name", "digits", "--image",
                 "img:0.1", "--gpus", "1", "--max-replicas", "3", "-o", str(out)]) == 0
    expected = build_inference_service(DeployConfig(**BASE, gpus=1, max_replicas=3))
    assert yaml.safe_load(out.read_text()) == expected
    assert main(["deploy", "render", "--model", BASE["model"], "--name", "digits",
                 "--image", "img:0.1"]) == 0
    assert yaml.safe_load(io.StringIO(capsys.readouterr().out))["metadata"]["name"] == "digits"
    assert main(["deploy", "render", "--model", "/local", "--name", "digits",
                 "--image", "img:0.1"]) == 2
    assert "storage URI" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve", "--help"], ["deploy", "render", "--help"]])
def test_cli_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert "usage: kfvision" in capsys.readouterr().out


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_predictor_pod_meets_the_restricted_pod_security_standard(config):
    from helpers.k8s_checks import restricted_problems

    predictor = build_inference_service(DeployConfig(**{**BASE, **CONFIGS[config]})
                                        )["spec"]["predictor"]
    assert restricted_problems(predictor) == []
    assert restricted_problems({**predictor, "securityContext": {}}) != []  # the check bites


def test_the_pipeline_parameters_deploy_options_name_exist():
    """An error about a DeployConfig field names it as the pipeline does (check-parameters):
    the parameter its declaration names must be one."""
    from kfvision.pipelines.flow.params import pipeline_options
    from kfvision.trainer.options import options_of

    named = {o.name: o.param for o in options_of(DeployConfig) if o.param}
    assert named == {"name": "deploy_name", "image": "image",
                     "service_account": "deploy_service_account"}
    assert set(named.values()) <= set(pipeline_options())


@pytest.mark.parametrize("options, queue, concurrency", [
    ({}, 16, 32),  # kfvision serve's batch of 32: half waiting, a pass of as many
    ({"max_batch_size": 8}, 4, 8),
    ({"max_batch_size": 8, "max_queue": 40}, 40, 48),  # a pass takes 8 at most
    ({"max_queue": 3}, 3, 6),
])
def test_container_concurrency_matches_the_servers_queue(options, queue, concurrency):
    """KServe's autoscaler and Knative's queue-proxy see the bound `kfvision serve` refuses
    beyond: the predictor's containerConcurrency, and --max-queue written out for the pod."""
    isvc = build_inference_service(DeployConfig(**{**BASE, **options}))
    predictor = isvc["spec"]["predictor"]
    assert predictor["containerConcurrency"] == concurrency
    args = predictor["containers"][0]["args"]
    assert args[args.index("--max-queue") + 1] == str(queue)
    rendered = yaml.safe_load(io.StringIO(yaml.safe_dump(isvc)))
    assert rendered["spec"]["predictor"]["containerConcurrency"] == concurrency
