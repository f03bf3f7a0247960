"""`kfvision job render`: the PyTorchJob passes the real CRD schema and the webhook's rules.

The CRD is Training Operator v1.9.4's (../shared/reference/kubeflow.org_pytorchjobs.yaml); the pod
template is also checked strictly against Kubernetes' own schema (kubernetes-validate), because
the CRD's structural schema would let a misspelt pod field through (the API server prunes it).
"""

import copy

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers import k8s_checks
from helpers.k8s_checks import unknown_fields

from kfvision.pipelines.cli import main
from kfvision.pipelines.clients.k8s import to_yaml
from kfvision.pipelines.jobs.config import JobConfig, Toleration, Volume, job_name, train_flags
from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.pytorchjob.build import build_pytorchjob
from kfvision.pipelines.jobs.pytorchjob.rules import validate_pytorchjob, webhook_problems
from kfvision.trainer.config import TrainConfig, config_from_args
from kfvision.trainer.errors import InvalidParameterError
from kfvision.trainer.train import get_args_parser

K8S_VERSION = "1.30"  # the kubernetes client we pin is 30.x
TRAIN = TrainConfig(model="/data/models/r18", train="/data/train", val="/data/val",
                    out="/data/models/trained", epochs=30, lr=0.05, image_size=64)
CONFIGS = {
    "cpu-1x1": dict(),
    "cpu-4x2": dict(nodes=4, procs_per_node=2, restart_policy="OnFailure", backoff_limit=5),
    "gpu-2x4": dict(nodes=2, gpus_per_node=4, node_selector=(("gpu", "a100"),),
                    tolerations=(Toleration("dedicated", "ml", "NoSchedule"),),
                    volumes=(Volume("kfvision-data", "/data"),), cpu="16", memory="64Gi",
                    shm_size="16Gi", active_deadline=86400, ttl=3600, namespace="team-a"),
    "gpu-3x1of2": dict(nodes=3, gpus_per_node=2, procs_per_node=1, restart_policy="Never"),
}


def job_of(**kwargs) -> dict:
    return build_pytorchjob(JobConfig(**{"name": "digits", "train": TRAIN,
                                         "image": "registry.example.com/kfvision:0.1", **kwargs}))


@pytest.fixture(scope="module")
def crd_schema() -> dict:
    return k8s_checks.crd_schema("kubeflow.org_pytorchjobs.yaml")


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_rendered_job_passes_the_crd_schema_with_no_field_pruned(config, crd_schema):
    job = job_of(**CONFIGS[config])
    jsonschema.validate(job, crd_schema)
    assert unknown_fields(job, crd_schema) == []
    assert webhook_problems(job) == []


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_pod_templates_pass_kubernetes_own_schema(config):
    for spec in job_of(**CONFIGS[config])["spec"]["pytorchReplicaSpecs"].values():
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": "t"}, "template": spec["template"]},
                                     K8S_VERSION, strict=True)


@pytest.mark.parametrize("nodes,gpus,procs,nproc", [
    (1, 0, None, "1"), (3, 0, 2, "2"), (2, 4, None, "4"), (2, 4, 2, "2")])
def test_replicas_devices_and_the_operator_conventions(nodes, gpus, procs, nproc):
    job = job_of(nodes=nodes, gpus_per_node=gpus, procs_per_node=procs)
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert job["spec"]["nprocPerNode"] == nproc
    assert specs["Master"]["replicas"] == 1
    assert specs.get("Worker", {}).get("replicas") == (nodes - 1 if nodes > 1 else None)
    for spec in specs.values():
        pod = spec["template"]
        assert pod["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        (c,) = pod["spec"]["containers"]
        assert c["name"] == "pytorch"
        assert c["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456,
                               "protocol": "TCP"}]
        # torchrun (through kfvision.trainer.launch, for its exit codes) takes its rendezvous from
        # the operator's PET_* variables: no flags of its own
        assert c["command"] == ["python", "-m", "kfvision.trainer.launch", "-m",
                                "kfvision.trainer.train"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
        assert not any(a.startswith(("--standalone", "--nnodes", "--nproc", "--rdzv",
                                     "--master", "--node-rank")) for a in c["args"])
        assert c.get("resources", {}).get("limits") == (
            {"nvidia.com/gpu": gpus} if gpus else None)
        shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        has_gpu_toleration = {"key": "nvidia.com/gpu", "operator": "Exists",
                              "effect": "NoSchedule"} in pod["spec"].get("tolerations", [])
        assert has_gpu_toleration == (gpus > 0)


def test_yaml_is_deterministic_and_round_trips():
    a = to_yaml(job_of(**CONFIGS["gpu-2x4"]), "header")
    assert a == to_yaml(job_of(**CONFIGS["gpu-2x4"]), "header")
    assert a.startswith("# header\napiVersion: kubeflow.org/v1\nkind: PyTorchJob\n")
    assert "&id" not in a and yaml.safe_load(a) == job_of(**CONFIGS["gpu-2x4"])


def test_training_flags_give_back_the_same_training_config():
    cfg = TrainConfig(model="/m", train="/t", val="/v", out="/o", epochs=7, lr=0.0003,
                      augment="light", weight_decay=0.0, seed=12, device="cuda")
    args = get_args_parser().parse_args(train_flags(cfg))
    assert config_from_args(args) == cfg
    assert train_flags(TrainConfig(model="/m", train="/t", val="/v", out="/o")) == [
        "--model", "/m", "--train", "/t", "--val", "/v", "--out", "/o"]


@pytest.mark.parametrize("kwargs,message", [
    (dict(gpus_per_node=2, procs_per_node=4), "--nproc-per-node 4 is more than --gpus-per-node 2"),
    (dict(name="Digits"), "not a DNS-1035 label"),
    (dict(name="1digits"), "not a DNS-1035 label"),
    (dict(name="my_job"), "not a DNS-1035 label"),
    (dict(name="a" * 60), "too long"),  # its Service a...-master-0 would pass 63
    (dict(name="a" * 55, nodes=12), "at most 53 characters"),  # ...-worker-10
    (dict(namespace="Team A"), "DNS-1123"),
    (dict(image="my image"), "not an image reference"),
    (dict(memory="16 GB"), "not a Kubernetes quantity"),
    (dict(tolerations=(Toleration("gpu", None, "NoRun"),)), "effect 'NoRun'"),
    (dict(volumes=(Volume("data", "relative/path"),)), "must be absolute"),
    (dict(volumes=(Volume("data", "/d"), Volume("more", "/d/"))), "used once"),
    (dict(volumes=(Volume("Bad_Claim", "/d"),)), "DNS-1123 subdomain"),
    (dict(node_selector=(("gpu", "a b"),)), "label value"),
    (dict(restart_policy="Sometimes"), "--restart-policy = 'Sometimes' is not valid; choose"),
])
def test_render_refuses_what_the_cluster_would(kwargs, message):
    with pytest.raises(InvalidJobError, match=message):
        job_of(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(nodes=0), "nodes = 0 is out of range"),
    (dict(run_as_user=0), "--run-as-user = 0"),
    (dict(backoff_limit=-1), "--backoff-limit = -1"),
])
def test_render_refuses_out_of_range_numbers(kwargs, message):
    with pytest.raises(InvalidParameterError, match=message):
        job_of(**kwargs)


def test_cuda_training_needs_gpus():
    cfg = JobConfig(name="d", image="i", train=TrainConfig(model="/m", train="/t", val="/v",
                                                           out="/o", device="cuda"))
    with pytest.raises(InvalidJobError, match="--device cuda needs GPUs"):
        build_pytorchjob(cfg)


def _master(job):
    return job["spec"]["pytorchReplicaSpecs"]["Master"]


BREAKS = [  # (rule of the reference README, how to break it, what the error says)
    ("1 name", lambda j: j["metadata"].update(name="Bad_Name"), "metadata.name"),
    ("2 specs required", lambda j: j["spec"].pop("pytorchReplicaSpecs"), "is required"),
    ("2 only Master/Worker", lambda j: j["spec"]["pytorchReplicaSpecs"].update(
        Chief=copy.deepcopy(_master(j))), "'Chief'"),
    ("3 a container", lambda j: _master(j)["template"]["spec"].update(containers=[]),
     "containers is empty"),
    ("3 an image", lambda j: _master(j)["template"]["spec"]["containers"][0].pop("image"),
     "has no image"),
    ("4 named pytorch", lambda j: _master(j)["template"]["spec"]["containers"][0].update(
        name="trainer"), "no container named exactly 'pytorch'"),
    ("5 Master written out", lambda j: _master(j).pop("replicas"), "must be written out"),
    ("5 Master is 1", lambda j: _master(j).update(replicas=2), "equal 1"),
    ("6 Worker >= 1", lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas=0),
     "Worker.replicas must be >= 1"),
    ("7 elastic needs Worker", lambda j: (j["spec"]["pytorchReplicaSpecs"].pop("Worker"),
                                          j["spec"].update(elasticPolicy={})),
     "elasticPolicy needs a Worker"),
    ("7 nProcPerNode", lambda j: j["spec"].update(elasticPolicy={"nProcPerNode": 2}),
     "may not be combined"),
    ("8 managedBy", lambda j: j["spec"]["runPolicy"].update(managedBy="me"), "managedBy 'me'"),
    ("restartPolicy", lambda j: _master(j).update(restartPolicy="Sometimes"), "restartPolicy"),
]


@pytest.mark.parametrize("rule,breaks,message", BREAKS, ids=[b[0] for b in BREAKS])
def test_each_webhook_rule_is_checked(rule, breaks, message):
    job = job_of(nodes=2)
    breaks(job)
    with pytest.raises(InvalidJobError, match="refused by the Training Operator's webhook") as e:
        validate_pytorchjob(job, "job.yaml")
    assert message in str(e.value) and "job.yaml" in str(e.value)


def test_render_command_writes_yaml_and_refuses_with_a_clear_error(tmp_path, capsys):
    out = tmp_path / "job.yaml"
    argv = ["job", "render", "--name", "digits", "--image", "img:1", "--nodes", "2",
            "--gpus-per-node", "2", "--toleration", "dedicated=ml:NoSchedule",
            "--node-selector", "gpu=t4", "--pvc", "data:/data", "--model", "/data/m",
            "--train", "/data/t", "--val", "/data/v", "--out", "/data/o", "--epochs", "3",
            "-o", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    assert text.splitlines()[1].startswith("# kfvision job render --name digits")
    job = yaml.safe_load(text)
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "t4"}
    assert {"key": "dedicated", "operator": "Equal", "value": "ml",
            "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["volumes"][1] == {"name": "pvc-0", "persistentVolumeClaim": {"claimName": "data"}}
    capsys.readouterr()
    assert main([*argv[:-2], "--procs-per-node", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: InvalidJobError: --nproc-per-node 3 is more than "
                          "--gpus-per-node 2")
    assert main([*argv[:-6], "--out", "/tmp/o", "--epochs", "3"]) == 0
    assert "warning: --out /tmp/o is not under a --pvc mount" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--toleration", "no-effect"), ("--pvc", "data"),
                                        ("--node-selector", "novalue")])
def test_render_flag_syntax_errors_exit_2(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["job", "render", "--name", "d", "--image", "i", flag, value, "--model", "m",
              "--train", "t", "--val", "v", "--out", "o"])
    assert e.value.code == 2 and value in capsys.readouterr().err


def test_job_names_from_run_ids_are_deterministic_and_valid():
    a = job_name("kfvision-train", "run-8f2c/1")
    assert a == job_name("kfvision-train", "run-8f2c/1") != job_name("kfvision-train", "other")
    assert a.startswith("kfvision-train-") and len(a) == len("kfvision-train-") + 10
    build_pytorchjob(JobConfig(name=a, image="i", train=TRAIN, nodes=16))
    with pytest.raises(InvalidJobError, match="prefix"):
        job_name("Train_Step", "run")
