"""The `image-classification` pipeline's parameters: which option each one is.

A training parameter is a TrainConfig field and a job parameter a JobConfig field (each
says its pipeline name where it differs: `learning_rate` is `lr`); the parameters of the pipeline
alone are PipelineInputs' fields below. The flags of `kfvision pipeline ...`, their help, the
checks and the steps' plumbing come from these. KFP needs literal signatures (the pipeline
function, the components): tests/test_options.py checks them against these declarations.
"""

from dataclasses import dataclass

from kfvision.pipelines.clients.registry import REGISTRIES
from kfvision.pipelines.jobs.config import JobConfig
from kfvision.pipelines.jobs.kinds import KINDS
from kfvision.pipelines.jobs.trainjob.rules import STOCK_RUNTIME
from kfvision.pipelines.script.manifest import LAUNCHERS
from kfvision.trainer.config import TrainConfig
from kfvision.trainer.errors import ref
from kfvision.trainer.options import option, options_of

EXECUTION_MODES = ("auto", "local", "cluster")
JOB_KINDS = ("auto", *(k.lower() for k in KINDS))  # auto, trainjob, pytorchjob


@dataclass(frozen=True)
class PipelineInputs:
    """The parameters that only the pipeline has: its sources, the model, where training runs."""

    train_source: str = option(help="labelled images: a folder, an archive or an http(s) URL",
                               doc="Class folders, as a folder or a .zip/.tar[.gz|.bz2] archive; "
                               "on a cluster a path on the data PVC (pvc_name), referenced "
                               "there.", pipeline=True)
    validation_source: str = option("", "labelled validation images (empty: split the training "
                                    "images)", pipeline=True)
    test_source: str = option("", "images to score and evaluate (empty: the validation images)",
                              pipeline=True)
    fraction: float = option(0.9, "share of each class kept for training when splitting",
                             pipeline=True)
    model_name: str = option("resnet18", "torchvision architecture", doc="Any name of "
                             "torchvision's classification list (docs/models.md).",
                             pipeline=True)
    pretrained: bool = option(False, "start from torchvision's ImageNet weights (downloaded: "
                              "needs network)", pipeline=True)
    zero_init_residual: bool = option(False, "ResNet: zero-init the last BN of each residual "
                                      "block", pipeline=True)
    memory_efficient: bool = option(False, "DenseNet: gradient checkpointing (less memory, "
                                    "slower)", pipeline=True)
    pvc_name: str = option("", "the PVC that holds your data on a cluster", doc="Mounted at "
                           "/kfvision-data in the steps and the job; only in a pipeline compiled "
                           "with --data-pvc, whose name is then the default.", pipeline=True)
    model_uri: str = option("", "s3://BUCKET/PREFIX/ the trained model is also written to",
                            doc="Replacing what is there; its KFP Model artifact stays. With "
                            "deploy on a cluster, the InferenceService's storageUri, so no data "
                            "PVC is needed. '': none.", pipeline=True)
    s3_secret: str = option("", "the Secret of AWS_* variables of the steps using s3://",
                            doc="Credentials and AWS_ENDPOINT_URL, which the steps reading s3:// "
                            "sources or writing model_uri get as environment; only in a pipeline "
                            "compiled with --s3-credentials, whose name is then the default.",
                            pipeline=True)
    execution_mode: str = option("auto", "where training runs: auto (cluster inside "
                                 "Kubernetes), local or cluster", choices=EXECUTION_MODES,
                                 pipeline=True)
    job_kind: str = option("auto", "the Kubeflow job the train step runs", doc="trainjob "
                           "(Kubeflow Trainer v2), pytorchjob (Training Operator v1.9), or auto: "
                           "on a cluster the one it serves, TrainJob first; locally a PyTorchJob.",
                           choices=JOB_KINDS, pipeline=True)
    trainer_runtime: str = option(STOCK_RUNTIME, "the TrainJob's ClusterTrainingRuntime",
                                  doc="The stock torch-distributed, or kfvision-torch (manifests/"
                                  "trainer-v2/: retries lost peers, fails bad input at once).",
                                  pipeline=True)
    script_source: str = option("", "your own training code instead of the built-in trainer",
                                doc="An s3:// URI of a packed source (a .tar.gz, as `kfvision "
                                "pipeline submit --source-store` uploads a folder of your "
                                "machine), or a folder the train step can read (locally any "
                                "folder; on a cluster one on the data PVC or the workspace). '': "
                                "the built-in trainer (docs/scripts.md, 'In the pipeline').",
                                pipeline=True)
    script_entry: str = option("", "the script in script_source: train.py, or -m pkg.module",
                               pipeline=True)
    script_args: str = option("", "the script's arguments, one string split as a shell would",
                              doc="e.g. `--epochs 3 --name 'a b'` (Python's shlex.split).",
                              pipeline=True)
    script_requirements: str = option("", "pip requirements in script_source ('': "
                                      "requirements.txt beside the entry, if any)",
                                      pipeline=True)
    script_launcher: str = option(LAUNCHERS[0], "torchrun, or python: one process per pod",
                                  choices=LAUNCHERS, pipeline=True)
    deploy: bool = option(False, "after evaluation, deploy the model", doc="On a cluster a "
                          "KServe InferenceService; locally serve it and check the served labels.",
                          pipeline=True)
    deploy_name: str = option("image-classifier", "the InferenceService's (and served model's) "
                              "name", pipeline=True)
    deploy_service_account: str = option("", "the InferenceService's ServiceAccount",
                                         doc="For an s3:// model_uri: the one KServe's S3 "
                                         "credentials are attached to. '': the namespace's "
                                         "default.",
                                         pipeline=True)
    deploy_min_accuracy: float = option(0.0, "deploy only when the evaluated accuracy reaches "
                                        "this", low=0.0, high=1.0, pipeline=True)
    register_name: str = option("", "after evaluation, register the model under this name",
                                doc="A version of this name in `registry`; MLflow's at "
                                "MLFLOW_TRACKING_URI (KFP 2.17 with MLflow; locally the demo's "
                                "store). '' registers nothing.", pipeline=True)
    register_min_accuracy: float = option(0.0, "register only when the evaluated accuracy "
                                          "reaches this", low=0.0, high=1.0, pipeline=True)
    registry: str = option("mlflow", "where register_name registers", doc="mlflow: MLflow's "
                           "registry at MLFLOW_TRACKING_URI; kubeflow: Kubeflow's Model Registry "
                           "at KFVISION_REGISTRY_URL, recording model_uri for KServe.",
                           choices=REGISTRIES, pipeline=True)


TRAIN_OPTIONS = tuple(o for o in options_of(TrainConfig) if o.param)
SCRIPT_OPTIONS = tuple(o for o in options_of(PipelineInputs) if o.name.startswith("script_"))
JOB_OPTIONS = tuple(o for o in options_of(JobConfig) if o.param)
# The parameter a JobConfig field comes from where it is no option of its own: the data PVC
# is the pipeline's one volume.
_FROM = {"volumes": "pvc_name"}


def pipeline_options() -> dict:
    """{parameter name: Option} of every parameter of the pipeline."""
    every = (*options_of(PipelineInputs), *TRAIN_OPTIONS, *JOB_OPTIONS)
    return {o.param: o for o in every}


def parameter_name(field: str) -> str:
    """The pipeline's name of a config field (how its errors name it): lr -> learning_rate."""
    names = {o.name: o.param for o in (*TRAIN_OPTIONS, *JOB_OPTIONS)}
    return names.get(field) or _FROM.get(field, field)


def parameter_ref(field: str) -> str:
    """How an error names the parameter of config field `field` (see kfvision.trainer.errors.ref):
    the pipeline's name in a step's log (learning_rate), its option's flag on the command line
    (--lr)."""
    name = parameter_name(field)
    opt = pipeline_options().get(name)
    return ref(name, opt.flag_name if opt else None)


def train_options(**params) -> dict:
    """The TrainConfig options (field names) of the pipeline's training parameters in `params`
    (other keys are ignored)."""
    return {o.name: o.from_param(params[o.param]) for o in TRAIN_OPTIONS}


def job_settings(**params) -> dict:
    """The pipeline's job parameters in `params`, by their pipeline names (other keys are
    ignored): what kfvision.pipelines.flow.steps.train.job_config takes."""
    return {o.param: params[o.param] for o in JOB_OPTIONS}


def script_settings(**params) -> dict:
    """The pipeline's script parameters in `params`, by name (other keys are ignored): what
    kfvision.pipelines.flow.steps.trainscript takes. Empty script_source: the built-in trainer."""
    return {o.param: params[o.param] for o in SCRIPT_OPTIONS}


def job_options(**settings) -> dict:
    """The JobConfig options (field names) of job settings: '' and 0 mean "not set" (KFP has
    no None), a list is one comma-separated string."""
    return {o.name: o.from_param(settings[o.param]) for o in JOB_OPTIONS}
