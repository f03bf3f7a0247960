"""`kfvision demo` (`make demo`): the whole KFP pipeline, run locally, on real data that ships
with scikit-learn (no download).

scikit-learn's handwritten digits (UCI, 1,797 8x8 images, 10 classes) are written as PNG files in
class folders, split 80/20 per class, then the `image-classification` pipeline runs on this
machine with KFP's local runner (`kfvision pipeline run-local`): convert both folders, write an
untrained resnet18, train it as a PyTorchJob run as local processes (job_kind auto, locally),
score the validation images, evaluate them, and deploy: serve the model with `kfvision serve` and
check the served labels.

Runs are tracked in a local MLflow store under `out`/mlflow (SQLite; MLFLOW_TRACKING_URI when
set wins): the train step forwards it into the job's processes, rank 0 logs every epoch, and
the pipeline's register step makes the trained model a version of `digits` there
(docs/tracking.md).
"""

import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

# Settings that reach >= 0.985 validation top-1 with resnet18 on CPU (see docs/cli.md, "Demo
# settings and measurements"), as the pipeline's parameters.
DEMO_TRAIN = {"image_size": 32, "batch_size": 32, "learning_rate": 0.05, "warmup_epochs": 1,
              "augment": "light", "patience": 5, "print_frequency": 20}

DEMO_REGISTER = "digits"  # the register step's name for the model

# The deploy step on: served locally and checked over v1 and v2 when accuracy reaches the bar.
DEMO_DEPLOY = {"deploy": True, "deploy_name": "digits", "deploy_min_accuracy": 0.95}


def write_digits(out, val_fraction: float = 0.2, seed: int = 1, limit: int | None = None) -> dict:
    """Write the digits as PNGs: out/train/<digit>/*.png and out/val/<digit>/*.png.

    The split is stratified (val_fraction of each class) and fixed by `seed`. `limit` keeps only
    the first images of each class (for quick tests). Returns {"train": n, "val": n}.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise SystemExit("the demo needs scikit-learn: pip install 'kfvision[demo]'") from e
    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)  # 0..16 -> 0..255
    rng = np.random.default_rng(seed)
    counts = {"train": 0, "val": 0}
    for label in range(10):
        idx = np.flatnonzero(digits.target == label)[:limit]
        idx = rng.permutation(idx)
        n_val = max(1, round(len(idx) * val_fraction))
        for rank, i in enumerate(idx):
            split = "val" if rank < n_val else "train"
            folder = Path(out) / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[i], "L").save(folder / f"digit_{i:04d}.png")
            counts[split] += 1
    return counts


def demo_arguments(raw: Path, epochs: int) -> dict:
    """The pipeline's arguments for the demo: the digits' own train/val folders, resnet18."""
    return {"train_source": str(raw / "train"), "validation_source": str(raw / "val"),
            "model_name": "resnet18", "epochs": epochs, "execution_mode": "local", **DEMO_TRAIN,
            **DEMO_DEPLOY}


def run_demo(out, epochs: int) -> int:
    """Write the digits under `out`/raw and run the whole pipeline locally into `out`/pipeline.

    `epochs` has no default here: `kfvision demo --epochs` holds it (one place)."""
    from kfvision.pipelines.flow.localrun import run_local_pipeline, summary

    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    counts = write_digits(out / "raw")
    print(f"wrote {counts['train']} training and {counts['val']} validation digit images as PNG "
          f"class folders in {out / 'raw'}", flush=True)
    tracking = _tracking(out / "mlflow")
    arguments = demo_arguments(out / "raw", epochs)
    if tracking:  # the pipeline's register step, into the demo's store
        arguments["register_name"] = DEMO_REGISTER
    settings = " ".join(f"{k}={v}" for k, v in arguments.items())
    print(f"running the image-classification pipeline locally (KFP local runner): {settings}",
          flush=True)
    run = run_local_pipeline(arguments, out / "pipeline")
    print("\ndemo finished\n" + summary(run))
    if tracking:
        _register(run, tracking)
    return 0


def _tracking(folder: Path) -> dict | None:
    """Track the demo in a local MLflow store (SQLite) unless MLFLOW_TRACKING_URI is set."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return {"uri": os.environ["MLFLOW_TRACKING_URI"], "ui": "the MLflow UI of that server"}
    try:
        from kfvision.pipelines.clients.registry import local_store

        store = local_store(folder)
    except ImportError:  # mlflow not installed: the demo runs untracked
        print("MLflow is not installed (pip install 'kfvision[test]'): the demo is not tracked")
        return None
    os.environ["MLFLOW_TRACKING_URI"] = store["uri"]  # the steps and the job's processes
    os.environ["MLFLOW_EXPERIMENT_NAME"] = store["experiment"]
    print(f"tracking the runs in MLflow: {store['uri']}", flush=True)
    return store


def _register(run, tracking: dict) -> None:
    """Say which version the register step made (registering again finds it by content)."""
    from kfvision.pipelines.clients.registry import register_mlflow
    from kfvision.pipelines.flow.localrun import find

    model = find(run, "train-pytorch-model", "trained_model")
    got = register_mlflow(model, DEMO_REGISTER,
                          experiment=os.environ.get("MLFLOW_EXPERIMENT_NAME", "kfvision"))
    print(f"MLflow: runs and curves in {tracking['uri']}; the model is registered as "
          f"models:/digits/{got['version']}\n  open the UI: {tracking['ui']}")
