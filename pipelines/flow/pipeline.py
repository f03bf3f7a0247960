"""The `image-classification` pipeline (KFP v2) and its compiler.

    check-parameters -> convert(train_source)
                     -> split                    (no validation_source)
                      | convert(validation_source)
                     -> resnet | densenet | torchvision-model (by model_name's family)
                     -> train-pytorch-model      (a TrainJob or PyTorchJob, locally or on a cluster;
                                                  the built-in trainer, or script_source's script)
                     -> score-image-model        (validation data, or convert(test_source))
                     -> evaluate-model
                     -> register-model           (register_name: a registry version; else a no-op)
                     -> deploy-model             (deploy: an InferenceService, or served locally;
                                                  the registered version when there is one)

The three choices are dsl.If/dsl.Else groups merged with dsl.OneOf, so the KFP UI shows the branch
taken. `image` sets every task's container image at run time (KFP backend 2.4 or later) and the
job's. Where the run's data lives on a cluster is fixed at compile time
(kfvision.pipelines.flow.storage.Storage, docs/pipeline.md "Storage"): by default the run's KFP
workspace, which the tasks that touch data mount (they take dsl.WORKSPACE_PATH_PLACEHOLDER), made
writable by `prepare-workspace` first; with a data PVC (`--data-pvc`), those tasks also mount the
PVC `pvc_name` at /kfvision-data; with a store (`--data-uri s3://...`) they pass the image
directories and the models through it and need neither (kfvision.pipelines.flow.steps.store).

Caching: on for the steps whose outputs are a function of their inputs (split, model, train,
score, evaluate, check), off for convert, which reads a path or URL whose contents can change,
register, which writes to a registry that changes outside the run, and deploy, which acts on the
cluster (or a local server).
"""

from concurrent.futures import ThreadPoolExecutor

from kfp import compiler, dsl, kubernetes

from kfvision.pipelines.clients.s3 import S3_SECRET_KEYS
from kfvision.pipelines.flow import components as c
from kfvision.pipelines.flow.storage import DATA_MOUNT, DEFAULT, Storage

PIPELINE_NAME = "image-classification"
DESCRIPTION = ("Convert labelled images to an image directory, split it, train a ResNet/DenseNet "
               "with PyTorch DDP as a Kubeflow TrainJob or PyTorchJob, score and evaluate it, "
               "register it (register_name) and deploy it (deploy).")
# Requests/limits of the steps other than training (which runs in the job's pods).
STEP_RESOURCES = {"cpu_request": "1", "cpu_limit": "4", "memory_request": "2G",
                  "memory_limit": "8G"}


def _step(task, image, *, cache: bool = True, pvc=None, name: str | None = None, secret=None):
    """Image, resources, caching (and the data PVC, and the S3 Secret's variables, where the
    step needs them) of a task."""
    task.set_container_image(image)
    task.set_cpu_request(STEP_RESOURCES["cpu_request"]).set_cpu_limit(STEP_RESOURCES["cpu_limit"])
    task.set_memory_request(STEP_RESOURCES["memory_request"])
    task.set_memory_limit(STEP_RESOURCES["memory_limit"])
    task.set_caching_options(enable_caching=cache)
    if pvc is not None:
        kubernetes.mount_pvc(task, pvc_name=pvc, mount_path=DATA_MOUNT)
    if secret is not None:  # optional: a Secret may hold only some of the variables
        kubernetes.use_secret_as_env(task, secret_name=secret, optional=True,
                                     secret_key_to_env={k: k for k in S3_SECRET_KEYS})
    if name:
        task.set_display_name(name)
    return task


def _inputs(component, params: dict) -> dict:
    """The pipeline's parameters that `component` takes, by name."""
    return {k: v for k, v in params.items() if k in component.component_spec.inputs}


def build_pipeline(storage: Storage = DEFAULT):
    """The pipeline with `storage` (kfvision.pipelines.flow.storage.Storage) compiled in.

    Built on a thread of its own: each of kfp's task setters (set_cpu_limit and the like) calls
    inspect.stack(), which finds the module of every frame on the stack, and a frame of Python's
    import machinery (this module builds the default pipeline when imported) is looked for in
    all of sys.modules every time: 7 s of CPU where torch is loaded (a test process), 0.1 s on a
    new thread's short stack."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_build, storage).result()


def _build(storage: Storage):
    ws = dsl.WORKSPACE_PATH_PLACEHOLDER if storage.workspace else ""

    @dsl.pipeline(name=PIPELINE_NAME, description=DESCRIPTION,
                  pipeline_config=storage.pipeline_config())
    def image_classification(
        train_source: str,
        validation_source: str = "",
        test_source: str = "",
        fraction: float = 0.9,
        model_name: str = "resnet18",
        pretrained: bool = False,
        zero_init_residual: bool = False,
        memory_efficient: bool = False,
        epochs: int = 5,
        batch_size: int = 16,
        warmup_epochs: int = 0,
        learning_rate: float = 0.001,
        random_seed: int = 1,
        patience: int = 3,
        print_frequency: int = 10,
        image_size: int = 224,
        augment: str = "",
        recipe: str = "azure",
        optimizer: str = "",
        lr_schedule: str = "",
        label_smoothing: float = 0.0,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        ema_decay: float = 0.0,
        freeze_backbone_epochs: int = 0,
        norm_weight_decay: float = 0.0,
        nodes: int = 1,
        procs_per_node: int = 0,
        gpus_per_node: int = 0,
        node_selector: str = "",
        tolerations: str = "",
        cpu_per_node: str = "",
        memory_per_node: str = "",
        shm_size: str = "",
        timeout_seconds: int = 0,
        image: str = c.DEFAULT_IMAGE,
        pvc_name: str = "",
        model_uri: str = "",
        s3_secret: str = "",
        service_account: str = "",
        scratch_size: str = "",
        scratch_class: str = "",
        execution_mode: str = "auto",
        job_kind: str = "auto",
        trainer_runtime: str = "torch-distributed",
        script_source: str = "",
        script_entry: str = "",
        script_args: str = "",
        script_requirements: str = "",
        script_launcher: str = "torchrun",
        deploy: bool = False,
        deploy_name: str = "image-classifier",
        deploy_service_account: str = "",
        deploy_min_accuracy: float = 0.0,
        register_name: str = "",
        register_min_accuracy: float = 0.0,
        registry: str = "mlflow",
    ):
        params = dict(locals())  # first statement: every parameter, by name
        pvc = pvc_name if storage.data_pvc else None  # the data PVC, where the step reads data
        secret = s3_secret if storage.s3_credentials else None  # the steps that talk to s3://
        store = storage.data_uri
        # with a store, split and score fetch from it too
        store_secret = secret if store else None
        data = {"workspace": ws}  # the inputs that make KFP mount the workspace in a task
        check = _step(c.check_parameters(**_inputs(c.check_parameters, params), store=store),
                      image, pvc=pvc)
        first = check  # what the steps that write data wait for
        if storage.workspace:
            first = _step(c.prepare_workspace(workspace=ws), image, cache=False).after(check)
            kubernetes.set_security_context(first, run_as_user=0, run_as_group=0,
                                            run_as_non_root=False)  # to open a new volume

        def convert(source, name, folder):
            return _step(c.convert_to_image_directory(
                source=source, run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, store=store,
                folder=folder, **data), image, cache=False, pvc=pvc, name=name,
                secret=secret).after(first)

        with dsl.If(validation_source == "", name="split-train-source"):
            whole = convert(train_source, "convert train source", "source")
            split = _step(c.split_image_directory(
                image_directory=whole.outputs["image_directory"], fraction=fraction,
                random_seed=random_seed, store=store, run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                **data), image, pvc=pvc, secret=store_secret)
        with dsl.Else(name="validation-source-given"):
            train_dir = convert(train_source, "convert train source", "train")
            val_dir = convert(validation_source, "convert validation source", "val")
        train_data = dsl.OneOf(split.outputs["train"], train_dir.outputs["image_directory"])
        val_data = dsl.OneOf(split.outputs["validation"], val_dir.outputs["image_directory"])

        with dsl.If(check.output == "resnet", name="resnet-family"):
            res = _step(c.resnet(model_name=model_name, pretrained=pretrained,
                                 zero_init_residual=zero_init_residual), image)
        with dsl.Elif(check.output == "densenet", name="densenet-family"):
            dense = _step(c.densenet(model_name=model_name, pretrained=pretrained,
                                     memory_efficient=memory_efficient), image)
        with dsl.Else(name="other-family"):
            other = _step(c.torchvision_model(model_name=model_name, pretrained=pretrained),
                          image)
        untrained = dsl.OneOf(res.outputs["model"], dense.outputs["model"],
                              other.outputs["model"])

        train = _step(c.train_pytorch_model(
            model=untrained, train=train_data, validation=val_data,
            run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, task_name=dsl.PIPELINE_TASK_NAME_PLACEHOLDER,
            store=store, **data, **_inputs(c.train_pytorch_model, params)), image, pvc=pvc,
            secret=secret)
        trained = train.outputs["trained_model"]

        with dsl.If(test_source == "", name="score-validation-data"):
            on_val = _step(c.score_image_model(trained_model=trained, image_directory=val_data,
                                               **data), image, pvc=pvc, secret=store_secret)
        with dsl.Else(name="score-test-source"):
            test_dir = convert(test_source, "convert test source", "test")
            on_test = _step(c.score_image_model(
                trained_model=trained, image_directory=test_dir.outputs["image_directory"],
                **data), image, pvc=pvc, secret=store_secret)
        evaluated = _step(c.evaluate_model(scored=dsl.OneOf(on_val.outputs["scored"],
                                                            on_test.outputs["scored"])), image)

        # Always runs (register_name '' is a reason it gives): deploy reads what it registered,
        # and KFP cannot hand a conditional task's output to a task outside its condition.
        registered = _step(c.register_model(trained_model=trained,
                                            evaluation=evaluated.outputs["evaluation"],
                                            run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                                            **_inputs(c.register_model, params)), image,
                           cache=False)

        with dsl.If(deploy == True, name="deploy"):  # noqa: E712 (a KFP condition, not a bool)
            _step(c.deploy_model(trained_model=trained, validation=val_data,
                                 evaluation=evaluated.outputs["evaluation"],
                                 registration=registered.outputs["registration"],
                                 run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, **data,
                                 **_inputs(c.deploy_model, params)), image, cache=False, pvc=pvc)

    return image_classification


image_classification = build_pipeline()


def compile_pipeline(path, image: str | None = None, storage: Storage = DEFAULT) -> None:
    """Write the pipeline's IR YAML (what the KFP UI and `kfp run create` take) to `path`.

    `image`: the default of the `image` parameter (else DEFAULT_IMAGE); a run can still set it.
    `storage`: where a run's data lives (validated; its data PVC becomes pvc_name's default).
    """
    storage.validate()
    args = {"pipeline_parameters": {"pvc_name": storage.data_pvc}} if storage.data_pvc else {}
    if storage.s3_credentials:
        args.setdefault("pipeline_parameters", {})["s3_secret"] = storage.s3_credentials
    if image:
        from kfvision.trainer.errors import InvalidParameterError

        if any(ch.isspace() for ch in image):
            raise InvalidParameterError(f"--image {image!r} is not an image reference; give one "
                                        "such as registry.example.com/kfvision-trainer:0.1.0.")
        args.setdefault("pipeline_parameters", {})["image"] = image
    pipeline = image_classification if storage == DEFAULT else build_pipeline(storage)
    compiler.Compiler().compile(pipeline, str(path), **args)


def parameter_defaults() -> dict:
    """{name: default} of the pipeline's parameters (train_source has none: it is required)."""
    import inspect

    sig = inspect.signature(image_classification.pipeline_func)
    return {n: (None if p.default is inspect.Parameter.empty else p.default)
            for n, p in sig.parameters.items()}
