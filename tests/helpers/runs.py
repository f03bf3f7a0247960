"""Runs of the trainer and of jobs that several test files start the same way."""

import json
from pathlib import Path

from PIL import Image

from kfvision.trainer.data.convert import convert


def train_argv(model, data: dict, out, **options) -> list:
    """Flags for kfvision.trainer.train.main / `kfvision train` (options as python names)."""
    argv = ["--model", str(model), "--train", str(data["train"]), "--val", str(data["val"]),
            "--out", str(out)]
    for k, v in options.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    return argv


def jpeg_digits(data: dict, root: Path, size: int) -> Path:
    """`data`'s raw validation digits as `size` px JPEGs (quality 90), converted: root/data."""
    for f in sorted((data["raw"] / "val").glob("*/*")):
        dest = root / "src" / f.parent.name / (f.stem + ".jpg")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(f) as im:
            im.convert("RGB").resize((size, size), Image.Resampling.BICUBIC).save(dest, quality=90)
    convert(root / "src", root / "data", progress=False)
    return root / "data"


# The digits (all 1,797) in 3 epochs at 32 px: what every training that must really learn them is
# held to (val top-1 > 0.9 here in fp32; 0.95 after 3 epochs on this EPYC): the made-once run
# with every other option at its default (tests/conftest.py `digits_trained`), the whole fast
# path (test_fastpath.py), the batched device path (test_devicedata.py), the GPU (test_gpu.py).
DIGITS_RUN = {"epochs": 3, "image_size": 32, "batch_size": 32, "lr": 0.05, "warmup_epochs": 1,
              "augment": "light", "print_freq": 1000}


# The CPU job that the distributed tests compare: 3 epochs of micro_digits (40 images) at 32 px,
# batch 4 on each of 4 processes (3 steps an epoch), with a progress line at every step (what the
# fault drills of test_resume_exact.py wait for), so that one unbroken run serves them all. How
# the images are loaded is left at its defaults ("standard" augmentation, `--cache auto`,
# `--workers -1`): from folders they are cached and read without workers, from s3:// (arriving
# images) uncached with a worker each, and both jobs must train the same weights.
JOB_FLAGS = ["--epochs", "3", "--image-size", "32", "--batch-size", "4", "--lr", "0.005",
             "--print-freq", "1", "--seed", "5", "--patience", "10"]


def render_job(root: Path, data: dict, model, *, kind="pytorchjob", nodes=2, nproc=2) -> Path:
    """`kfvision job render` of a `nodes` x `nproc` CPU job of `kind` (JOB_FLAGS), named
    digits-KIND-NODESxNPROC, its model to root/model-NAME: the manifest's path."""
    from kfvision.pipelines.cli import main

    name = f"digits-{kind}-{nodes}x{nproc}"
    manifest = root / f"{name}.yaml"
    kind_flags = ["--kind", "trainjob", "--runtime", "kfvision-torch"] if kind == "trainjob" \
        else []
    assert main(["job", "render", *kind_flags, "--name", name, "--image", "local",
                 "--nodes", str(nodes), "--procs-per-node", str(nproc), "--model", str(model),
                 "--train", str(data["train"]), "--val", str(data["val"]),
                 "--out", str(root / f"model-{name}"), *JOB_FLAGS, "-o", str(manifest)]) == 0
    return manifest


def run_job(root: Path, data: dict, model, *, kind="pytorchjob", nodes=2, nproc=2) -> dict:
    """render_job's job, run with `kfvision job run-local`.

    Returns {"rc": run-local's exit code, "out": the model directory, "metrics": its
    metrics.json, "logs": the log folder}.
    """
    from kfvision.pipelines.cli import main

    manifest = render_job(root, data, model, kind=kind, nodes=nodes, nproc=nproc)
    out, logs = root / f"model-{manifest.stem}", root / f"logs-{manifest.stem}"
    rc = main(["job", "run-local", str(manifest), "--quiet", "--log-dir", str(logs)])
    return {"rc": rc, "out": out, "metrics": json.loads((out / "metrics.json").read_text()),
            "logs": logs}


def pipeline_job_settings(**over) -> dict:
    """Every job parameter of the pipeline (flow/params.py's JOB_OPTIONS, the one list) at its
    default, `over` replacing some: what the train step's `settings` take."""
    from kfvision.pipelines.flow.params import JOB_OPTIONS
    from kfvision.pipelines.flow.pipeline import parameter_defaults

    return {**{o.param: parameter_defaults()[o.param] for o in JOB_OPTIONS}, **over}


def pipeline_train_options(**over) -> dict:
    """The train step's `options` from the pipeline's training parameters at their defaults,
    `over` (by parameter name) replacing some: every option, as the pipeline passes them."""
    from kfvision.pipelines.flow.params import train_options
    from kfvision.pipelines.flow.pipeline import parameter_defaults

    return train_options(**{**parameter_defaults(), **over})


def weight_differences(a: dict, b: dict) -> str:
    """'' when every tensor of two state dicts is equal, else how many differ and by how much at
    most."""
    import torch

    differ = {k: (a[k].double() - b[k].double()).abs().max().item() for k in a
              if not torch.equal(a[k], b[k])}
    if not differ:
        return ""
    worst = sorted(differ.items(), key=lambda kv: -kv[1])[:3]
    return (f"{len(differ)} of {len(a)} tensors differ, by up to {worst[0][1]:.3g} ("
            + ", ".join(f"{k} {d:.3g}" for k, d in worst) + ")")
