"""What a user's script can rely on: the folders it gets, under kfvision's names and under the
names SageMaker and Vertex AI give the same folders, so that scripts written for those run
unchanged. The table in docs/scripts.md is this module; `contract_env` is the one function that
writes it.

| folder | kfvision | SageMaker | Vertex AI |
|---|---|---|---|
| model (uploaded after success) | KFVISION_MODEL_DIR | SM_MODEL_DIR | AIP_MODEL_DIR |
| outputs (= ./outputs, Azure's) | KFVISION_OUTPUT_DIR | SM_OUTPUT_DATA_DIR | |
| checkpoints (survive a restart) | KFVISION_CHECKPOINT_DIR | | AIP_CHECKPOINT_DIR |
| TensorBoard logs | KFVISION_TENSORBOARD_DIR | | AIP_TENSORBOARD_LOG_DIR |
| data channel NAME | KFVISION_INPUT_<NAME> | SM_CHANNEL_<NAME> (+ SM_CHANNELS) | |
"""

import json
import os
from pathlib import Path

# Ours.
MODEL_DIR = "KFVISION_MODEL_DIR"
OUTPUT_DIR = "KFVISION_OUTPUT_DIR"
CHECKPOINT_DIR = "KFVISION_CHECKPOINT_DIR"
TENSORBOARD_DIR = "KFVISION_TENSORBOARD_DIR"
INPUT_PREFIX = "KFVISION_INPUT_"
SOURCE_SHA256 = "KFVISION_SOURCE_SHA256"
# What the boot writes into the model folder after success, so that the folder says where it came
# from wherever it is copied (`kfvision register` tags the version with the snapshot's sha256):
# {"source_sha256", "entry", "args", "mlflow_run_id", "mlflow_tracking_uri"}. The model readers
# ignore files they do not know (trainer/model/scripted.py).
PROVENANCE = "kfvision-source.json"
# Where node 0's work folder is mounted in a script job's pods (its model/ and outputs/ below), and
# the annotation that carries --output-uri as given: `job download` reads both
# (pipelines/jobs/outputs.py).
WORK_MOUNT = "/kfvision/work"
OUTPUT_ANNOTATION = "kfvision.dev/output-uri"
# What node 0 keeps after success, under the boot's work folder, by the names they have under
# --output-uri (URI/model/, URI/outputs/); SUCCEEDED (in the work folder) says it got there.
RESULTS = {"model": "model", "outputs": "src/outputs"}
SUCCEEDED = "succeeded"
# run-local's stand-in for a pod's own filesystem (pipelines/jobs/volumes.py): absolute paths of
# the pod's emptyDir and ConfigMap mounts are found under it. Never set on a cluster.
POD_ROOT = "KFVISION_POD_ROOT"
# A job whose data, model or outputs are s3:// URIs runs the node agent (pipelines/jobs/
# storenode.py) with the training flags: it fetches what the node's ranks read into the pod's own
# scratch disk (mounted at SCRATCH_MOUNT, or where SCRATCH_ENV says) and sends checkpoints and
# the model back to the store.
STORE_COMMAND = ("python", "-m", "kfvision.pipelines.jobs.storenode")
SCRATCH_MOUNT = "/kfvision-scratch"
SCRATCH_ENV = "KFVISION_SCRATCH"
# Where the boot keeps requirement environments (default: ~/.cache/kfvision/envs when writable)
ENV_CACHE = "KFVISION_ENV_CACHE"

# SageMaker: aws/sagemaker-training-toolkit v4.4.1, src/sagemaker_training/environment.py
# (Environment.to_env_vars: each property as SM_<NAME>; channel_input_dirs as SM_CHANNEL_<NAME>,
# upper-cased) and ENVIRONMENT_VARIABLES.md; the PyTorch estimator's scripts read the same
# (aws/sagemaker-python-sdk v2, doc/frameworks/pytorch/using_pytorch.rst).
SM_MODEL_DIR = "SM_MODEL_DIR"
SM_OUTPUT_DATA_DIR = "SM_OUTPUT_DATA_DIR"
SM_CHANNEL_PREFIX = "SM_CHANNEL_"
SM_CHANNELS = "SM_CHANNELS"  # a JSON list of the channel names
SM_NUM_GPUS = "SM_NUM_GPUS"
SM_HOSTS = "SM_HOSTS"  # a JSON list of the hosts
SM_CURRENT_HOST = "SM_CURRENT_HOST"

# Vertex AI: googleapis/googleapis google/cloud/aiplatform/v1/custom_job.proto (@01af66a),
# CustomJobSpec.base_output_directory: what the service sets from it in every worker.
AIP_MODEL_DIR = "AIP_MODEL_DIR"
AIP_CHECKPOINT_DIR = "AIP_CHECKPOINT_DIR"
AIP_TENSORBOARD_LOG_DIR = "AIP_TENSORBOARD_LOG_DIR"


def pod_path(path: str) -> Path:
    """`path` as this pod sees it: under run-local's stand-in for the pod's own volumes when it
    is there (POD_ROOT), else as it is."""
    root = os.environ.get(POD_ROOT)
    if root and path.startswith("/"):
        local = Path(root) / path.lstrip("/")
        if local.exists():
            return local
    return Path(path)


def channel_key(name: str) -> str:
    """A channel's name as the variables spell it: `train-data` -> TRAIN_DATA."""
    return name.upper().replace("-", "_")


def contract_env(*, model: str, outputs: str, checkpoints: str, tensorboard: str,
                 inputs: dict, gpus: int, hosts: list, current_host: str, sha256: str) -> dict:
    """Every variable of the contract (the table above), as strings."""
    env = {MODEL_DIR: model, OUTPUT_DIR: outputs, CHECKPOINT_DIR: checkpoints,
           TENSORBOARD_DIR: tensorboard, SOURCE_SHA256: sha256,
           SM_MODEL_DIR: model, SM_OUTPUT_DATA_DIR: outputs,
           SM_CHANNELS: json.dumps(sorted(inputs)), SM_NUM_GPUS: str(gpus),
           SM_HOSTS: json.dumps(hosts), SM_CURRENT_HOST: current_host,
           AIP_MODEL_DIR: model, AIP_CHECKPOINT_DIR: checkpoints,
           AIP_TENSORBOARD_LOG_DIR: tensorboard}
    for name, path in inputs.items():
        env[INPUT_PREFIX + channel_key(name)] = path
        env[SM_CHANNEL_PREFIX + channel_key(name)] = path
    return env


def read_provenance(model_dir) -> dict:
    """The PROVENANCE record of a model folder, or {} (none, or not a JSON object)."""
    from pathlib import Path

    try:
        got = json.loads((Path(model_dir) / PROVENANCE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}
