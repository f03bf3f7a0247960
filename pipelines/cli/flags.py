"""The flags several commands share, added in one place: a job's kind (`job render|run`, `tune
render`), a user's script (`job render|run --source`, `tune run|render --source`), torchrun's
process count (`train`, `tune run`), and where a rendered file goes (-o). The options themselves
are declared once in their tables (JobConfig, TrainConfig); the cluster's flags are
pipelines/cli/clusterargs.py's."""

import argparse
import sys
from pathlib import Path

from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.fromflags import KINDS
from kfvision.pipelines.jobs.trainjob.rules import RUNTIME_KINDS
from kfvision.trainer.options import ArgumentParser, add_flags

RENDER_DESCRIPTION = (
    "Write a kubeflow.org/v1 PyTorchJob: Master (+ Workers when --nodes > 1), or with --kind "
    "trainjob a Kubeflow Trainer v2 TrainJob of --nodes nodes, each running `torchrun -m "
    "kfvision.trainer.train` with the training flags below. Paths are as the pods see them (e.g. "
    "under a --pvc mount), or s3:// URIs (the pods then fetch and push through a scratch volume; "
    "each s3:// input is checked first).")
NPROC_FLAG = "--nproc-per-node"  # torchrun's spelling, as `kfvision job render` has it


def _pair(flag: str):
    def parse(text: str) -> tuple:
        name, sep, value = text.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not NAME=VALUE")
        return name, value
    parse.__name__ = flag
    return parse


def add_script_flags(parser, *, positional: bool = True) -> None:
    """The flags of a user's script (one group), and the script's arguments after `--`."""
    from kfvision.pipelines.script.manifest import LAUNCHERS

    g = parser.add_argument_group("your own script (instead of the built-in trainer; "
                                  "docs/scripts.md)")
    g.add_argument("--source", metavar="DIR", help="folder of your training code, packed "
                   "into the job")
    g.add_argument("--entry", metavar="FILE", help="the script to run, relative to --source")
    g.add_argument("-m", "--module", metavar="NAME", help="or the module to run (python -m)")
    g.add_argument("--console-script", metavar="NAME", help="or a script of the source's "
                   "pyproject.toml [project.scripts]")
    g.add_argument("--requirements", metavar="FILE", help="pip requirements, relative to "
                   "--source (default: requirements.txt beside the entry, or at --source)")
    g.add_argument("--workdir", metavar="DIR", help="folder to run in, relative to --source "
                   "(a Dockerfile's WORKDIR)")
    g.add_argument("--launcher", choices=LAUNCHERS, default="torchrun",
                   help="torchrun, or python: one process per pod, the operator's RANK/WORLD_SIZE")
    g.add_argument("--input", type=_pair("--input"), action="append", default=[],
                   metavar="NAME=URI", help="data channel: s3://, pvc://CLAIM/PATH or a pod "
                   "path (repeatable)")
    g.add_argument("--collect", action="append", default=[], metavar="DIR", help="a folder the "
                   "script writes where it runs, kept under outputs/ (repeatable)")
    g.add_argument("--output-uri", metavar="URI", help="where model/ and outputs/ go after "
                   "success: s3://, pvc://CLAIM/PATH or a pod path")
    g.add_argument("--source-store", metavar="S3_URI", help="object-store prefix for a "
                   "snapshot too big for a ConfigMap")
    g.add_argument("--source-pvc", metavar="DIR", help="or a folder on a --pvc mount that "
                   "holds the snapshot")
    g.add_argument("--include-secret", action="append", default=[], metavar="PATH",
                   help="pack this secret-looking file anyway (repeatable)")
    g.add_argument("--env", type=_pair("--env"), action="append", default=[],
                   metavar="NAME=VALUE", help="environment variable for the script (repeatable)")
    g.add_argument("--progress-total", type=_pair("--progress-total"), action="append",
                   default=[], metavar="NAME=N", help="the total the script does not print "
                   "(epochs=10, total_steps=5000): progress percentage and time left")
    g.add_argument("--no-progress-reports", action="store_true", help="no progress reports "
                   "from kfvision (the script posts its own)")
    g.add_argument("--no-check-requirements", action="store_true", help="do not check the "
                   "requirements against the image's pinned torch and torchvision")
    if positional:
        g.add_argument("script_args", nargs="*", metavar="-- SCRIPT_ARGS",
                       help="the script's own arguments, after --")


def relax_trainer_paths(parser) -> None:
    """The built-in trainer's four paths are required only without --source (checked in
    `check_mode`)."""
    for action in parser._actions:
        if action.dest in ("model", "train", "val", "out"):
            action.required = False


def add_kind_flags(g) -> None:
    g.add_argument("--kind", choices=KINDS, default="pytorchjob", help="PyTorchJob (Training "
                   "Operator v1.9) or TrainJob (Kubeflow Trainer v2)")
    g.add_argument("--runtime", help="TrainJob: the runtime to reference (default: the stock "
                   "torch-distributed)")
    g.add_argument("--runtime-kind", choices=RUNTIME_KINDS,
                   help="TrainJob: the runtime's kind (default: ClusterTrainingRuntime)")


def write_rendered(text: str, output: str | None) -> None:
    """`text` to -o's file (its folder made), or to standard output for none or '-'."""
    if output in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text, encoding="utf-8")


def run_args(args) -> argparse.Namespace:
    """The `run-local` / `submit` arguments of a `job run` (their defaults, its choices)."""
    if args.source is None:
        raise InvalidJobError("kfvision job run needs --source DIR (and --entry or --module): "
                              "it runs your own script; the built-in trainer renders with "
                              "`kfvision job render`.")
    return argparse.Namespace(manifest=args.output, namespace=args.namespace, wait=args.wait,
                              timeout=args.timeout, keep_on_timeout=args.keep_on_timeout,
                              poll=args.poll, no_logs=False, log_dir=args.log_dir,
                              quiet=args.quiet, grace=30.0, fault=[],
                              no_sandbox=args.no_sandbox)


def add_no_sandbox(group) -> None:
    """`--no-sandbox` of `job run-local` and `job run` (pipelines/jobs/sandbox.py)."""
    group.add_argument("--no-sandbox", action="store_true", help="run the pods with this "
                       "machine's filesystem and user, not inside the pod's (bwrap)")


def job_render_parser() -> argparse.ArgumentParser:
    """`kfvision job render`'s flags (no help flag: a parent parser), which `tune render` takes
    too: the training flags, the job's, its kind, -o, and a user's script's."""
    from kfvision.pipelines.jobs.fromflags import JOB_OPTIONS
    from kfvision.trainer.config import get_args_parser

    r = ArgumentParser(add_help=False, parents=[get_args_parser(add_help=False)])
    g = r.add_argument_group("job")
    add_flags(g, JOB_OPTIONS)
    add_kind_flags(g)
    g.add_argument("-o", "--output", help="YAML file to write (default: standard output)")
    g.add_argument("--no-check-store", action="store_true",
                   help="skip checking the s3:// inputs (this machine cannot reach the store)")
    add_script_flags(r)  # a user's own script (pipelines/script/assemble.py)
    relax_trainer_paths(r)
    return r
