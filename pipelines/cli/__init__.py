"""The `kfvision` command line. Run `kfvision --help`, or `kfvision COMMAND --help`.

One module per command group: data (convert, pack, split), model, train, use (score, evaluate,
export), job (the Kubeflow job), pipeline (the KFP pipeline, demo), tune (hyperparameter
search). The flags of train, job, pipeline and tune come from modules that import kfp or the job
builders, so only the command named on the command line gets them (`kfvision --help` stays instant).
"""

import argparse
import importlib
import sys

from kfvision.pipelines.cli import data, model, use
from kfvision.pipelines.cli.pipeline import register_demo
from kfvision.trainer.errors import KfvisionError
from kfvision.trainer.exitcodes import error_line
from kfvision.trainer.heap import freeze_at_exit
from kfvision.trainer.options import ArgumentParser

EPILOG = """\
typical run (no cluster needed):
  kfvision convert photos.tar.gz data/all        # class folders (folder or archive)
  kfvision split data/all data/train data/val    # 90/10 per class
  kfvision model resnet models/r18 --name resnet18
  kfvision train --model models/r18 --train data/train --val data/val --out models/r18-trained
  kfvision score --model models/r18-trained --data data/val --out scored.csv
  kfvision evaluate --scored scored.csv --out eval/
  kfvision export --model models/r18-trained --format onnx --out r18.onnx --check data/val
  kfvision demo                                  # all of the above on scikit-learn's digits
"""

# The one-line help of the command groups whose flags are built only when they are named.
HELP = {
    "train": "train a model (one process, or N with --nproc-per-node)",
    "job": "train as a Kubeflow PyTorchJob or TrainJob: render, run-local, submit, logs, "
           "delete",
    "pipeline": "the Kubeflow Pipelines pipeline, images to a registered, deployed model: "
                "compile, submit, run-local",
    "serve": "serve a trained model with KServe's model server (v1 and v2 protocols)",
    "deploy": "deploy a trained model on KServe: render, submit, delete an InferenceService",
    "tune": "hyperparameter search: run (Optuna, here), render, submit, status, delete "
            "(Katib)",
    "register": "register a trained model: a version in MLflow's or Kubeflow's model registry",
}


def build_parser(argv: list | None = None) -> argparse.ArgumentParser:
    """The `kfvision` parser. With `argv`, the flags of only the command it names are built."""
    argv = [] if argv is None else list(argv)
    named = argv[0] if argv else None
    p = ArgumentParser(  # never expands an abbreviation; its sub-commands' parsers neither
        prog="kfvision", description="Train image classifiers with PyTorch DDP, on this machine "
        "or as Kubeflow jobs (PyTorchJob or TrainJob).", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    data.register(sub)
    model.register(sub)
    use.register(sub)
    register_demo(sub)
    for name, help in HELP.items():
        if named != name:
            sub.add_parser(name, help=help)
        else:
            importlib.import_module(f"kfvision.pipelines.cli.{name}").register(sub, help)
    return p


def main(argv=None) -> int:
    freeze_at_exit()  # the process exits in 0.2 s, not 0.9, once torch is imported
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except KfvisionError as e:
        print(error_line(e), file=sys.stderr)
        return e.exit_code
