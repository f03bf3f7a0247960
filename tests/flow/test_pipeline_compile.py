"""The compiled `image-classification` pipeline: golden file, loads back with the kfp SDK, and the
settings a cluster run depends on are in the YAML (run-time job names, image, PVC, resources)."""

import copy
import os
import subprocess
import sys

import pytest
import yaml
from helpers.paths import REPO

from kfvision.pipelines.flow.pipeline import PIPELINE_NAME, compile_pipeline, parameter_defaults

GOLDEN = REPO / "tests" / "golden" / "pipeline-image-classification.yaml"
UPDATE = os.environ.get("KFVISION_UPDATE_GOLDEN") == "1"


def stable(docs: list) -> list:
    """The compiled documents less what changes with the kfp release rather than with us: the
    SDK version and each executor's command (kfp's launcher prelude plus the component's
    embedded source, which test_every_step_runs_a_kfvision_function checks instead)."""
    docs = copy.deepcopy(docs)
    spec = docs[0]
    spec.pop("sdkVersion", None)
    for executor in spec["deploymentSpec"]["executors"].values():
        executor["container"].pop("command", None)
    return docs


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple:
    path = tmp_path_factory.mktemp("pipeline") / "pipeline.yaml"
    compile_pipeline(path)
    return path, list(yaml.safe_load_all(path.read_text()))


def test_compiled_pipeline_matches_the_golden_file(compiled):
    text = yaml.safe_dump_all(stable(compiled[1]), sort_keys=True, width=100)
    if UPDATE:
        GOLDEN.write_text("# Regenerate with `make golden-pipeline`; review the diff.\n" + text)
    assert GOLDEN.read_text().split("\n", 1)[1] == text, (
        "the compiled pipeline changed: run `make golden-pipeline` and review the diff")


def test_it_loads_back_with_the_kfp_sdk(compiled):
    from kfp import components

    loaded = components.load_component_from_file(str(compiled[0]))
    assert loaded.name == PIPELINE_NAME
    inputs = loaded.component_spec.inputs
    assert set(inputs) == set(parameter_defaults())
    assert inputs["train_source"].default is None and not inputs["train_source"].optional
    assert inputs["epochs"].default == 5 and inputs["learning_rate"].default == 0.001
    assert inputs["batch_size"].default == 16 and inputs["patience"].default == 3


def _tasks(spec: dict) -> dict:
    """Every task of every DAG, by task name (branches are nested DAG components)."""
    out = {}
    for dag in [spec["root"]] + list(spec["components"].values()):
        out.update((dag.get("dag") or {}).get("tasks") or {})
    return out


def test_the_train_step_carries_the_cluster_settings(compiled):
    spec, platform = compiled[1]
    task = _tasks(spec)["train-pytorch-model"]
    params = task["inputs"]["parameters"]
    for name in ("nodes", "procs_per_node", "gpus_per_node", "node_selector", "tolerations",
                 "cpu_per_node", "memory_per_node", "shm_size", "timeout_seconds", "image",
                 "pvc_name", "execution_mode", "job_kind", "trainer_runtime", "epochs",
                 "learning_rate"):
        assert params[name] == {"componentInputParameter": name}, name
    # The job name comes from the run, resolved by KFP when the step runs: never compile-time.
    assert params["run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
    assert params["task_name"]["runtimeValue"]["constant"] == "{{$.pipeline_task_name}}"
    train_exec = spec["deploymentSpec"]["executors"]["exec-train-pytorch-model"]["container"]
    assert train_exec["image"] == "{{$.inputs.parameters['pipelinechannel--image']}}"
    for output in ("trained_model", "metrics", "curves", "job"):
        assert output in spec["components"]["comp-train-pytorch-model"]["outputDefinitions"][
            "artifacts"]


def test_every_step_runs_a_kfvision_function_from_the_image(compiled):
    spec = compiled[1][0]
    executors = spec["deploymentSpec"]["executors"]
    # one executor per task: check, prepare-workspace, 4 converts, split, resnet, densenet,
    # torchvision-model, train, 2 scores, evaluate, register, deploy
    assert len(executors) == 16
    for name, executor in executors.items():
        c = executor["container"]
        text = " ".join(c["command"])
        assert "kfp.dsl.executor_main" in text and "pip install" not in text, name
        # a thin shell over kfvision.pipelines.flow.steps & co
        assert "from kfvision.pipelines." in text, name
        assert c["image"] == "{{$.inputs.parameters['pipelinechannel--image']}}", name
        assert c["resources"]["resourceCpuRequest"] == "1", name
        assert c["resources"]["resourceMemoryLimit"] == "8G", name


def test_caching_is_off_only_where_a_step_reads_a_changing_source_or_deploys(compiled):
    # (or registers: the registry, like a cluster, is a changing outside system)
    tasks = _tasks(compiled[1][0])
    for name, task in tasks.items():
        if "componentRef" not in task or name.startswith("condition"):
            continue
        cached = task.get("cachingOptions", {}).get("enableCache", False)
        assert cached == (not name.startswith(("convert-to-image-directory", "deploy-model",
                                               "register-model", "prepare-workspace"))), name


def test_the_three_choices_are_conditions_merged_with_oneof(compiled):
    tasks = _tasks(compiled[1][0])
    conditions = {t["triggerPolicy"]["condition"] for t in tasks.values() if "triggerPolicy" in t}
    for channel, value in (("validation_source", "''"), ("test_source", "''"),
                           ("check-parameters-Output", "'resnet'")):
        when = f"inputs.parameter_values['pipelinechannel--{channel}'] == {value}"
        assert {when, f"!({when})"} <= conditions or channel.startswith("check")
    # the model's family: resnet, elif densenet, else any other (If/Elif/Else)
    family = "inputs.parameter_values['pipelinechannel--check-parameters-Output']"
    assert {f"{family} == 'resnet'", f"!({family} == 'resnet') && {family} == 'densenet'"} <= (
        conditions)
    assert "inputs.parameter_values['pipelinechannel--deploy'] == true" in conditions
    # train's model, train and validation inputs and evaluate's scored table: dsl.OneOf
    text = compiled[0].read_text()
    assert text.count("artifactSelectors") >= 4


@pytest.mark.process  # `kfvision pipeline compile` in a process: 0.9 s of CPU (kfp)
def test_compile_command_writes_a_loadable_pipeline_with_the_image_default(tmp_path):
    out = tmp_path / "p.yaml"
    run = subprocess.run([sys.executable, "-m", "kfvision.pipelines.cli", "pipeline", "compile",
                          "-o",
                          str(out), "--image", "registry.local/kfvision:1.2.3"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "kfp run create -e EXPERIMENT" in run.stdout
    from kfp import components

    loaded = components.load_component_from_file(str(out))
    assert loaded.component_spec.inputs["image"].default == "registry.local/kfvision:1.2.3"


DATA_STEPS = ("convert-to-image-directory", "split-image-directory", "train-pytorch-model",
              "score-image-model", "deploy-model")  # the tasks that read or write the data


def _data_tasks(spec) -> dict:
    return {n: t for n, t in _tasks(spec).items() if "componentRef" in t
            and not n.startswith("condition") and n.startswith(DATA_STEPS)}


def test_by_default_the_run_keeps_its_data_in_a_kfp_workspace_mounted_where_used(compiled):
    spec, platform = compiled[1]
    config = platform["platforms"]["kubernetes"]["pipelineConfig"]["workspace"]
    assert config == {"size": "50Gi", "kubernetes": {"pvcSpecPatch": {
        "accessModes": ["ReadWriteMany"]}}}
    # KFP mounts the workspace in the tasks whose inputs name it (and only those)
    for name, task in _tasks(spec).items():
        if "componentRef" not in task or name.startswith("condition"):
            continue
        ws = task["inputs"].get("parameters", {}).get("workspace")
        named = ws == {"runtimeValue": {"constant": "{{$.workspace_path}}"}}
        assert named == name.startswith((*DATA_STEPS, "prepare-workspace")), name
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert not any("pvcMount" in e for e in executors.values())  # no hand-made PVC
    assert executors["exec-prepare-workspace"]["securityContext"]["runAsUser"] == "0"
    assert "pvc_name" in parameter_defaults() and parameter_defaults()["pvc_name"] == ""


@pytest.mark.parametrize("workspace_size", ["50Gi", ""])
def test_with_a_data_pvc_every_step_that_reads_data_mounts_it(tmp_path, workspace_size):
    from kfvision.pipelines.flow.storage import Storage

    path = tmp_path / "p.yaml"
    compile_pipeline(path, storage=Storage(workspace_size=workspace_size,
                                           data_pvc="kfvision-data"))
    spec, platform = yaml.safe_load_all(path.read_text())
    assert spec["root"]["inputDefinitions"]["parameters"]["pvc_name"]["defaultValue"] == \
        "kfvision-data"
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, task in _data_tasks(spec).items():
        (mount,) = executors[task["componentRef"]["name"].replace("comp-", "exec-")]["pvcMount"]
        assert mount["mountPath"] == "/kfvision-data", name
        assert mount["pvcNameParameter"]["componentInputParameter"] in (
            "pvc_name", "pipelinechannel--pvc_name"), name  # inside a condition: its channel
    config = platform["platforms"]["kubernetes"].get("pipelineConfig", {})
    assert ("workspace" in config) == bool(workspace_size)
    assert ("exec-prepare-workspace" in executors) == bool(workspace_size)


def test_nothing_runs_before_the_parameters_are_checked(compiled):
    # On the backend, tasks without a dependency start at once: every one must wait for check.
    tasks = compiled[1][0]["root"]["dag"]["tasks"]

    def upstream(name: str) -> set:
        direct = set(tasks[name].get("dependentTasks", []))
        return direct.union(*(upstream(d) for d in direct)) if direct else set()

    for name in tasks:
        if name != "check-parameters":
            assert "check-parameters" in upstream(name), name
