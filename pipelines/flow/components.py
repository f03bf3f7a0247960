"""The KFP v2 components of kfvision: thin shells over kfvision.pipelines.flow.steps and
kfvision.pipelines.flow.steps.train.

Each is a Lightweight Python Component whose body imports one ordinary function, calls it with the
local paths of its artifacts and its parameters, and logs what the KFP UI shows. The image (the
kfvision trainer image, `images/Dockerfile`) already has kfvision and kfp installed, so nothing is
pip-installed at run time (`install_kfp_package=False`): steps work without network access.
The pipeline sets every task's image from its `image` parameter; DEFAULT_IMAGE is the fallback.

A component that reads or writes the run's data takes `workspace` (the pipeline passes
dsl.WORKSPACE_PATH_PLACEHOLDER when it has a workspace, else ''): KFP mounts the workspace only
in the tasks whose inputs name it (see kfvision.pipelines.flow.storage). A component that writes
data into a pipeline's store takes `store` (its --data-uri, '' for none); the next one finds the
directory by its input artifact's metadata `store_uri` (kfvision.pipelines.flow.steps.store).

Components and their outputs:
    prepare-workspace            -> (nothing: makes the workspace's kfvision folder writable)
    check-parameters             -> the model family (every parameter validated, nothing else run)
    convert-to-image-directory   -> image_directory (Dataset)
    split-image-directory        -> train, validation (Dataset)
    resnet / densenet / torchvision-model -> model (Model: the untrained model directory)
    train-pytorch-model          -> trained_model (Model), metrics (Metrics), curves (HTML),
                                    job (Artifact: the rendered TrainJob or PyTorchJob YAML)
    score-image-model            -> scored (Dataset: CSV, one row per image)
    evaluate-model               -> metrics (Metrics), confusion_matrix (ClassificationMetrics),
                                    report (Markdown), page (HTML), evaluation (Artifact: folder)
    deploy-model                 -> metrics (Metrics), deployment (Artifact: folder with the
                                    InferenceService YAML or the local server's log)
"""

from kfp import dsl
from kfp.dsl import (
    HTML,
    Artifact,
    ClassificationMetrics,
    Dataset,
    Input,
    Markdown,
    Metrics,
    Model,
    Output,
)

DEFAULT_IMAGE = "registry.example.com/kfvision-trainer:0.1.0"


def component(func):
    """A kfvision component: the trainer image, kfp taken from the image, not pip."""
    return dsl.component(func, base_image=DEFAULT_IMAGE, install_kfp_package=False)


@component
def check_parameters(train_source: str, validation_source: str, test_source: str,
                     fraction: float, model_name: str, epochs: int, batch_size: int,
                     warmup_epochs: int, learning_rate: float, random_seed: int, patience: int,
                     print_frequency: int, image_size: int, augment: str,
                     recipe: str, optimizer: str, lr_schedule: str,
                     label_smoothing: float, mixup_alpha: float, cutmix_alpha: float,
                     ema_decay: float, freeze_backbone_epochs: int,
                     norm_weight_decay: float, nodes: int,
                     procs_per_node: int, gpus_per_node: int, node_selector: str,
                     tolerations: str, cpu_per_node: str, memory_per_node: str, shm_size: str,
                     timeout_seconds: int, image: str, pvc_name: str, model_uri: str,
                     s3_secret: str, service_account: str, scratch_size: str,
                     scratch_class: str, execution_mode: str, job_kind: str,
                     trainer_runtime: str, script_source: str, script_entry: str,
                     script_args: str, script_requirements: str, script_launcher: str,
                     deploy: bool, deploy_name: str,
                     deploy_service_account: str, deploy_min_accuracy: float,
                     register_name: str, register_min_accuracy: float,
                     registry: str, store: str = "") -> str:
    """Validate every parameter of the pipeline (fail before any heavy work); returns the
    model family of model_name ("resnet", "densenet", "convnext", ...)."""
    params = dict(locals())  # first statement: exactly the parameters
    from kfvision.pipelines.flow.steps.check import check_parameters as check
    from kfvision.pipelines.flow.steps.common import run

    return run(check, **params)


@component
def prepare_workspace(workspace: str):
    """Make the run's workspace writable by the steps and the job (run as root, once)."""
    from kfvision.pipelines.flow.steps.common import run
    from kfvision.pipelines.flow.storage import prepare_workspace as prepare

    print(run(prepare, workspace))


@component
def convert_to_image_directory(source: str, image_directory: Output[Dataset],
                               labels: str = "", workspace: str = "", run_id: str = "",
                               store: str = "", folder: str = ""):
    """Convert to Image Directory: a folder, archive or http(s) URL of labelled images. The
    output is the manifest (and samples.jpg): images already on a volume stay there, an
    archive is extracted once into the run's data place; with a store, the images go to
    store/<run>/<folder>/."""
    from kfvision.pipelines.flow.steps.common import resolve_mode, run
    from kfvision.pipelines.flow.steps.data import convert_step
    from kfvision.pipelines.flow.storage import data_place, run_prefix

    place = data_place(workspace, run_id, cluster=resolve_mode("auto") == "cluster")
    result = run(convert_step, source, image_directory.path, labels=labels, place=place,
                 store_uri=run_prefix(store, run_id, folder) if store else "")
    print(result.pop("summary"))
    image_directory.metadata.update({"source": source, **result})


@component
def split_image_directory(image_directory: Input[Dataset], train: Output[Dataset],
                          validation: Output[Dataset], fraction: float = 0.9,
                          random_seed: int = 1, workspace: str = "", store: str = "",
                          run_id: str = ""):
    """Split Image Directory: `fraction` of each class to train, the rest to validation (two
    manifests over the same images; with a store, both pushed to store/<run>/train, val)."""
    from kfvision.pipelines.flow.steps.common import run
    from kfvision.pipelines.flow.steps.data import split_step
    from kfvision.pipelines.flow.steps.store import METADATA_KEY
    from kfvision.pipelines.flow.storage import run_prefix

    uris = (image_directory.metadata[METADATA_KEY], run_prefix(store, run_id, "train"),
            run_prefix(store, run_id, "val")) if store else ()
    counts = run(split_step, image_directory.path, train.path, validation.path, fraction,
                 random_seed, store_uris=uris)
    for side, uri in zip((train, validation), uris[1:], strict=False):
        side.metadata.update({METADATA_KEY: uri, "images_root": uri})
    print(f"split into {counts['train_images']} training and {counts['validation_images']} "
          "validation images")
    train.metadata["images"] = counts["train_images"]
    validation.metadata["images"] = counts["validation_images"]


@component
def resnet(model: Output[Model], model_name: str = "resnet18", pretrained: bool = False,
           zero_init_residual: bool = False):
    """ResNet: an untrained torchvision ResNet/ResNeXt/Wide ResNet model directory."""
    from kfvision.pipelines.flow.steps.common import run
    from kfvision.pipelines.flow.steps.model import model_step

    model.metadata.update(run(model_step, model.path, model_name, pretrained,
                              zero_init_residual=zero_init_residual))


@component
def densenet(model: Output[Model], model_name: str = "densenet121", pretrained: bool = False,
             memory_efficient: bool = False):
    """DenseNet: an untrained torchvision DenseNet model directory."""
    from kfvision.pipelines.flow.steps.common import run
    from kfvision.pipelines.flow.steps.model import model_step

    model.metadata.update(run(model_step, model.path, model_name, pretrained,
                              memory_efficient=memory_efficient))


@component
def torchvision_model(model: Output[Model], model_name: str = "resnet18",
                      pretrained: bool = False):
    """Any other torchvision classifier: an untrained model directory (its family's defaults)."""
    from kfvision.pipelines.flow.steps.common import run
    from kfvision.pipelines.flow.steps.model import model_step

    model.metadata.update(run(model_step, model.path, model_name, pretrained))


@component
def train_pytorch_model(model: Input[Model], train: Input[Dataset], validation: Input[Dataset],
                        trained_model: Output[Model], metrics: Output[Metrics],
                        curves: Output[HTML], job: Output[Artifact], image: str,
                        run_id: str, task_name: str, epochs: int = 5, batch_size: int = 16,
                        warmup_epochs: int = 0, learning_rate: float = 0.001,
                        random_seed: int = 1, patience: int = 3, print_frequency: int = 10,
                        image_size: int = 224, augment: str = "", recipe: str = "azure",
                        optimizer: str = "", lr_schedule: str = "",
                        label_smoothing: float = 0.0, mixup_alpha: float = 0.0,
                        cutmix_alpha: float = 0.0, ema_decay: float = 0.0,
                        freeze_backbone_epochs: int = 0, norm_weight_decay: float = 0.0,
                        nodes: int = 1,
                        procs_per_node: int = 0, gpus_per_node: int = 0,
                        node_selector: str = "", tolerations: str = "", cpu_per_node: str = "",
                        memory_per_node: str = "", shm_size: str = "", timeout_seconds: int = 0,
                        pvc_name: str = "", execution_mode: str = "auto",
                        job_kind: str = "auto", trainer_runtime: str = "torch-distributed",
                        workspace: str = "", model_uri: str = "", script_source: str = "",
                        script_entry: str = "", script_args: str = "",
                        script_requirements: str = "", script_launcher: str = "torchrun",
                        store: str = "", s3_secret: str = "", service_account: str = "",
                        scratch_size: str = "", scratch_class: str = ""):
    """Train PyTorch Model: a TrainJob or PyTorchJob (torchrun, DDP) of the built-in trainer, or
    of your own script (script_source: then `model` is not used), on the cluster inside
    Kubernetes and as local processes elsewhere; the trained model, its metrics and curves."""
    params = dict(locals())  # first statement: exactly the parameters
    from kfvision.pipelines.flow.pages import curves_html, train_metrics
    from kfvision.pipelines.flow.params import job_settings, script_settings, train_options
    from kfvision.pipelines.flow.steps.common import run, unique_run_key
    from kfvision.pipelines.flow.steps.model import push_model_step
    from kfvision.pipelines.flow.steps.store import METADATA_KEY, job_paths
    from kfvision.pipelines.flow.steps.train import job_summary, train_step
    from kfvision.pipelines.flow.steps.trainscript import script_train_step

    where = dict(settings=job_settings(**params), run_key=unique_run_key(run_id, task_name),
                 mode=execution_mode, pvc_name=pvc_name, kind=job_kind, runtime=trainer_runtime,
                 workspace=workspace)
    paths = job_paths(store, run_id, train.metadata[METADATA_KEY],
                      validation.metadata[METADATA_KEY]) if store else None
    if script_source:
        summary = run(script_train_step, train.path, validation.path, trained_model.path,
                      job.path, script=script_settings(**params), **where)
    else:
        summary = run(train_step, model.path, train.path, validation.path, trained_model.path,
                      job.path, options=train_options(**params), store=paths,
                      s3_secret=s3_secret, **where)
    for key, value in train_metrics(summary).items():
        metrics.log_metric(key, value)
    with open(curves.path, "w", encoding="utf-8") as f:
        f.write(curves_html(summary))
    job.metadata.update(job_summary(job.path))
    trained_model.metadata.update({"framework": "pytorch", **summary["final"]})
    if paths:  # where score, register and deploy find it
        trained_model.metadata[METADATA_KEY] = paths["out"]
    if model_uri:  # for KServe and `--model s3://...`; the Model artifact keeps the lineage
        trained_model.metadata.update(run(push_model_step, trained_model.path, model_uri))


@component
def score_image_model(trained_model: Input[Model], image_directory: Input[Dataset],
                      scored: Output[Dataset], workspace: str = ""):
    """Score Image Model: one CSV row per image, predicted label and class probabilities."""
    from kfvision.pipelines.flow.steps.common import run
    from kfvision.pipelines.flow.steps.store import METADATA_KEY
    from kfvision.pipelines.flow.steps.use import score_step

    result = run(score_step, trained_model.path, image_directory.path, scored.path,
                 store_uri=image_directory.metadata.get(METADATA_KEY, ""))
    print(f"scored {result['rows']} images" + ("" if result["accuracy"] is None else
                                               f", top-1 {result['accuracy']:.4f}"))
    scored.metadata.update({"rows": result["rows"], "format": "csv"})


@component
def evaluate_model(scored: Input[Dataset], metrics: Output[Metrics],
                   confusion_matrix: Output[ClassificationMetrics], report: Output[Markdown],
                   page: Output[HTML], evaluation: Output[Artifact]):
    """Evaluate Model: accuracy, top-5, per-class precision/recall/F1, the confusion matrix."""
    from pathlib import Path

    from kfvision.pipelines.flow.pages import evaluation_html
    from kfvision.pipelines.flow.steps.common import run
    from kfvision.pipelines.flow.steps.use import evaluate_step

    m = run(evaluate_step, scored.path, evaluation.path)
    out = Path(evaluation.path)
    metrics.log_metric("accuracy", round(m["accuracy"], 6))
    metrics.log_metric(f"top{m['top_k']}_accuracy", round(m["top5_accuracy"], 6))
    for avg in ("macro_avg", "weighted_avg"):
        metrics.log_metric(f"{avg.replace('_avg', '')}_f1", round(m[avg]["f1"], 6))
    confusion_matrix.log_confusion_matrix(m["classes"], m["confusion_matrix"])
    text = (out / "report.md").read_text(encoding="utf-8")
    Path(report.path).write_text(text.replace("![confusion matrix](confusion_matrix.png)",
                                              "(the picture is in the HTML page)"),
                                 encoding="utf-8")
    Path(page.path).write_text(evaluation_html((out / "confusion_matrix.png").read_bytes(), m),
                               encoding="utf-8")
    print(f"evaluated {m['rows']} images: accuracy {m['accuracy']:.4f}, "
          f"top-{m['top_k']} {m['top5_accuracy']:.4f}, macro F1 {m['macro_avg']['f1']:.4f}")


@component
def deploy_model(trained_model: Input[Model], validation: Input[Dataset],
                 evaluation: Input[Artifact], registration: Input[Artifact],
                 metrics: Output[Metrics],
                 deployment: Output[Artifact], image: str, run_id: str,
                 deploy_name: str = "image-classifier", deploy_min_accuracy: float = 0.0,
                 pvc_name: str = "", execution_mode: str = "auto", workspace: str = "",
                 model_uri: str = "", deploy_service_account: str = ""):
    """Deploy Model: if accurate enough, a KServe InferenceService on the cluster; locally the
    model served by `kfvision serve` and checked over v1 and v2 against the scored labels. The
    version the register step registered, when it did, is what is served."""
    from kfvision.pipelines.flow.steps.common import run
    from kfvision.pipelines.flow.steps.deploy import deploy_step
    from kfvision.pipelines.flow.steps.store import METADATA_KEY

    figures = run(deploy_step, trained_model.path, validation.path, evaluation.path,
                  deployment.path, name=deploy_name,
                  min_accuracy=deploy_min_accuracy, mode=execution_mode, image=image,
                  pvc_name=pvc_name, run_key=run_id,
                  model_uri=model_uri or trained_model.metadata.get(METADATA_KEY, ""),
                  service_account=deploy_service_account,
                  registration_dir=registration.path,
                  val_uri=validation.metadata.get(METADATA_KEY, ""))
    for key, value in figures.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics.log_metric(key, value)
    deployment.metadata.update({k: v for k, v in figures.items() if v is not None})


@component
def register_model(trained_model: Input[Model], evaluation: Input[Artifact],
                   registration: Output[Artifact], run_id: str, register_name: str = "",
                   register_min_accuracy: float = 0.0, registry: str = "mlflow",
                   model_uri: str = ""):
    """Register Model: if named and accurate enough, a version of `register_name` in `registry`,
    MLflow's or Kubeflow's (kfvision.pipelines.flow.steps.register); otherwise it says why and
    succeeds.
    `registration` (a folder) tells the deploy step what was registered."""
    from kfvision.pipelines.flow.steps.common import run
    from kfvision.pipelines.flow.steps.register import register_step
    from kfvision.pipelines.flow.steps.store import METADATA_KEY

    got = run(register_step, trained_model.path, evaluation.path, name=register_name,
              min_accuracy=register_min_accuracy, pipeline_run=run_id, registry=registry,
              storage_uri=model_uri or trained_model.metadata.get(METADATA_KEY, ""),
              out_dir=registration.path)
    registration.metadata.update({k: v for k, v in got.items() if v is not None})
