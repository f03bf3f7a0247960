"""`kfvision tune run | render`: hyperparameter search, on this machine (Optuna) or as a Katib
Experiment whose trials are the jobs `kfvision job render` makes. See docs/tuning.md."""

import argparse
import sys
from pathlib import Path

from pipelines.tune.experiment import ALGORITHMS, EARLY_STOPPING, Search
from pipelines.tune.space import check_space, parse_param
from trainer.errors import InvalidParameterError
from trainer.options import HelpFormatter
from trainer.reporting import OBJECTIVES

EPILOG = """\
the same search, two ways:
  kfvision tune run --model M --train T --val V --out tuning/ --trials 8 --parallel 2 \\
      --param lr=double:0.0001:0.1:log --param warmup-epochs=int:0:2 --epochs 5
  kfvision tune render --name digits-lr --image IMAGE --model M --train T --val V \\
      --out /mnt/runs/tune --pvc runs:/mnt/runs --param lr=double:0.0001:0.1:log -o exp.yaml
  kubectl apply -f exp.yaml
"""


def _param(text: str):
    try:
        return parse_param(text)
    except InvalidParameterError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _search_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("search")
    g.add_argument("--param", type=_param, action="append", default=[], metavar="NAME=TYPE:SPEC",
                   help="a searched training flag, repeatable: lr=double:0.0001:0.1:log, "
                   "warmup-epochs=int:0:3, batch-size=categorical:16,32,64")
    g.add_argument("--objective", choices=sorted(OBJECTIVES), default="validation-loss",
                   help="metric to optimise (of the epoch the model keeps)")
    g.add_argument("--algorithm", choices=sorted(ALGORITHMS), default="tpe",
                   help="search algorithm")
    g.add_argument("--trials", type=int, default=8, help="trials in all")
    g.add_argument("--parallel", type=int, default=1, help="trials at once")
    g.add_argument("--max-failed", type=int, default=3, help="failed trials before giving up")
    g.add_argument("--early-stopping", choices=sorted(EARLY_STOPPING), default="none",
                   help="median: stop a trial whose per-epoch objective is worse than the "
                   "median of the trials before at that epoch")


def _search(args, base) -> Search:
    # more failures allowed than trials means "never give up": Katib wants it said as <= trials
    max_failed = min(args.max_failed, args.trials)
    search = Search(tuple(args.param), args.objective, args.algorithm, args.trials,
                    args.parallel, max_failed, args.early_stopping)
    from pipelines.tune.local import check_search

    check_search(search)
    check_space(list(search.params), base)
    return search


def _run(args) -> int:
    from pipelines.tune.local import run_search
    from trainer.config import config_from_args
    from trainer.train import setup_logging

    base = config_from_args(args)
    search = _search(args, base)
    setup_logging(True)
    summary = run_search(base, search, args.nproc_per_node)
    best = summary["best"]
    if best is None:
        print(f"error: no trial completed; see {base.out}/trials/*.log", file=sys.stderr)
        return 1
    print(f"best trial {best['number']}: {search.objective} {best['value']:.4f} with "
          f"{best['params']}; model in {best['model']}; all trials in {base.out}/trials.csv")
    return 0


def _render(args) -> int:
    import dataclasses

    from pipelines.cli.job import build_job, job_config
    from pipelines.jobs.manifest import to_yaml
    from pipelines.tune.experiment import TRIAL_KINDS, build_experiment

    cfg = job_config(args)
    search = _search(args, cfg.train)
    # rendered under a name as long as a trial's (<experiment>-<8 characters>): the pods' names
    # grow from it
    job, _ = build_job(args, dataclasses.replace(cfg, name=f"{cfg.name}-abcd1234"))
    experiment = build_experiment(job, TRIAL_KINDS[args.kind], search, cfg.name, cfg.namespace)
    text = to_yaml(experiment, "Rendered by `kfvision tune render` (docs/tuning.md): re-render "
                   "rather than edit.")
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote Experiment {cfg.name} ({search.trials} trials of {job['kind']}) to "
              f"{args.output}", file=sys.stderr)
    return 0


def _job_render_parser() -> argparse.ArgumentParser:
    """`kfvision job render`'s parser: the job and training flags, declared there once."""
    from pipelines.cli import job

    sub = argparse.ArgumentParser(add_help=False).add_subparsers()
    job._add_render(sub)
    return sub.choices["render"]


def register(subparsers, help: str) -> None:
    from trainer.config import get_args_parser

    t = subparsers.add_parser("tune", help=help, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = t.add_subparsers(dest="verb", required=True, metavar="VERB")
    run = verbs.add_parser("run", parents=[get_args_parser(add_help=False)],
                           help="search on this machine (Optuna); --out is the search's folder",
                           formatter_class=HelpFormatter)
    _search_arguments(run)
    run.add_argument("--nproc-per-node", type=int, default=1,
                     help="training processes per trial (torchrun when > 1)")
    run.set_defaults(func=_run)
    render = verbs.add_parser("render", parents=[_job_render_parser()], add_help=False,
                              conflict_handler="resolve",
                              help="write a Katib Experiment whose trials are `job render` jobs",
                              formatter_class=HelpFormatter)
    render.add_argument("-h", "--help", action="help", help="show this help message and exit")
    _search_arguments(render)  # --kind, --runtime, --runtime-kind: job render's (the trials')
    render.set_defaults(func=_render)
