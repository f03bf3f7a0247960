"""The `kfvision` command line. Run `kfvision --help`, or `kfvision COMMAND --help`.

One module per command group, and HELP below holds every command's one-line help:
    data        convert, pack, split: image directories
    model       model (an untrained model directory)
    store       push (an image directory or a model directory to s3://)
    use         score, evaluate, export
    pipeline    pipeline compile | submit | run-local (the KFP pipeline), and demo
    train       train (one process, or N with torchrun)
    job         job render | run-local | submit | logs | delete | run | download (PyTorchJob,
                TrainJob; jobscript.py: job run and download, jobstatus.py: status and list)
    serve       serve (KServe's model server)
    deploy      deploy render | submit | delete (a KServe InferenceService)
    tune        tune run | render | submit | status | delete (Optuna here, Katib there)
    register    register (MLflow's or Kubeflow's model registry)
Two modules are no group: clusterargs.py (the flags every command that talks to a cluster shares,
declared once, and the one body of every `submit`) and flags.py (the job, script and -o flags
several commands share). A command module parses, calls a package, and prints; it imports no
other command module (tests/test_architecture.py). The flags of train, job, pipeline, serve,
deploy, tune and register come from modules that import kfp or the job builders, so only the
command named on the command line gets them (`kfvision --help` stays instant).
"""

import argparse
import importlib
import sys

from kfvision.pipelines.cli import data, model, store, use
from kfvision.pipelines.cli.pipeline import register_demo
from kfvision.trainer.errors import KfvisionError
from kfvision.trainer.exitcodes import error_line
from kfvision.trainer.heap import freeze_at_exit
from kfvision.trainer.options import ArgumentParser

EPILOG = """\
typical run (no cluster needed):
  kfvision convert photos.tar.gz data/all        # class folders (folder or archive)
  kfvision split data/all data/train data/val    # 90/10 per class
  kfvision model resnet18 models/r18
  kfvision train --model models/r18 --train data/train --val data/val --out models/r18-trained
  kfvision score --model models/r18-trained --data data/val --out scored.csv
  kfvision evaluate --scored scored.csv --out eval/
  kfvision export --model models/r18-trained --format onnx --out r18.onnx --check data/val
  kfvision demo                                  # all of the above on scikit-learn's digits
"""

# Every command's one-line help, in the order `kfvision --help` lists them.
HELP = {
    "convert": "a folder or archive of images -> an image directory",
    "pack": "add raw pixels to an image directory: fast training without decoding",
    "split": "split an image directory in two, stratified by class",
    "model": "write an untrained model directory (any torchvision classifier)",
    "push": "upload an image directory or a model directory to s3://",
    "score": "score an image directory with a trained model -> CSV",
    "evaluate": "metrics, report and confusion matrix of a scored CSV",
    "export": "export a trained model: ONNX, TorchScript, torch.export",
    "demo": "the whole KFP pipeline, run locally, on scikit-learn's digits",
    "train": "train a model (one process, or N with --nproc-per-node)",
    "job": "train as a Kubeflow PyTorchJob or TrainJob: render, run, run-local, submit, logs, "
           "delete, download",
    "pipeline": "the Kubeflow Pipelines pipeline, images to a registered, deployed model: "
                "compile, submit, run-local",
    "serve": "serve a trained model with KServe's model server (v1 and v2 protocols)",
    "deploy": "deploy a trained model on KServe: render, submit, delete an InferenceService",
    "tune": "hyperparameter search: run (Optuna, here), render, submit, status, delete "
            "(Katib)",
    "register": "register a trained model: a version in MLflow's or Kubeflow's model registry",
}
# The commands whose flags are built only when they are named (module: the command's name).
LAZY = ("train", "job", "pipeline", "serve", "deploy", "tune", "register")


def build_parser(argv: list | None = None) -> argparse.ArgumentParser:
    """The `kfvision` parser. With `argv`, the flags of only the command it names are built."""
    argv = [] if argv is None else list(argv)
    named = argv[0] if argv else None
    p = ArgumentParser(  # never expands an abbreviation; its sub-commands' parsers neither
        prog="kfvision", description="Train image classifiers with PyTorch DDP, on this machine "
        "or as Kubeflow jobs (PyTorchJob or TrainJob).", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    data.register(sub, HELP)
    model.register(sub, HELP)
    store.register(sub, HELP)
    use.register(sub, HELP)
    register_demo(sub, HELP["demo"])
    for name in LAZY:
        if named != name:
            sub.add_parser(name, help=HELP[name])
        else:
            importlib.import_module(f"kfvision.pipelines.cli.{name}").register(sub, HELP[name])
    return p


def main(argv=None) -> int:
    # exiting once torch is imported costs a fraction of what it did (trainer/heap.py; figures:
    # docs/benchmarks.md, section "Start and exit of kfvision's programs")
    freeze_at_exit()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except KfvisionError as e:
        print(error_line(e), file=sys.stderr)
        return e.exit_code
