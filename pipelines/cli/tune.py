"""`kfvision tune run | render | submit | status | delete`: hyperparameter search, on this machine
(Optuna) or as a Katib Experiment whose trials are the jobs `kfvision job render` makes. See
docs/tuning.md."""

import argparse
import sys
from pathlib import Path

from kfvision.pipelines.cli.clusterargs import add_command, add_submit, submit_command
from kfvision.pipelines.cli.flags import (
    NPROC_FLAG,
    add_script_flags,
    job_render_parser,
    relax_trainer_paths,
    write_rendered,
)
from kfvision.pipelines.tune import experimentclient
from kfvision.pipelines.tune.experiment import Search
from kfvision.pipelines.tune.space import check_space
from kfvision.trainer.errors import InvalidParameterError
from kfvision.trainer.options import HelpFormatter, add_flags, options_of

EPILOG = """\
the same search, two ways:
  kfvision tune run --model M --train T --val V --out tuning/ --trials 8 --parallel 2 \\
      --param lr=double:0.0001:0.1:log --param warmup-epochs=int:0:2 --epochs 5
  kfvision tune render --name digits-lr --image IMAGE --model M --train T --val V \\
      --out /mnt/runs/tune --pvc runs:/mnt/runs --param lr=double:0.0001:0.1:log -o exp.yaml
  kfvision tune submit exp.yaml --wait     # or: kubectl apply -f exp.yaml
"""


def _search_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p.add_argument_group("search"), options_of(Search))


def _search(args, base=None) -> Search:
    """The search of the flags: over the built-in trainer's flags (`base`: its fixed values), or
    with base None over a user's script's placeholders (pipelines/tune/script.py)."""
    from kfvision.pipelines.tune.script import check_placeholders
    from kfvision.pipelines.tune.study import check_search

    # more failures allowed than trials means "never give up": Katib wants it said as <= trials
    max_failed = min(args.max_failed, args.trials)
    given = {o.name: getattr(args, o.name) for o in options_of(Search)}
    params = tuple(args.params) if base is None else check_space(args.params, base)
    search = Search(**{**given, "params": params, "max_failed": max_failed})
    check_search(search, script=base is None)
    if base is None:
        check_placeholders(args.script_args, params)
    return search


def _script_mode(args) -> bool:
    """True for a user's script (--source); `tune run`'s --out is the search's folder then, not
    a flag of the built-in trainer."""
    from kfvision.pipelines.script.assemble import check_mode

    out = args.out
    if args.source is not None and args.func is _run:
        args.out = None
    try:
        return check_mode(args)
    finally:
        args.out = out


def _run(args) -> int:
    from kfvision.pipelines.tune.study import TrainerTrial, run_search
    from kfvision.trainer.config import config_from_args
    from kfvision.trainer.train import setup_logging

    if _script_mode(args):
        return _run_script(args)
    if args.nodes != 1:
        raise InvalidParameterError("--nodes is for --source (a script's local job); the "
                                    "built-in trainer's trials run on one machine: use "
                                    f"{NPROC_FLAG}.")
    base = config_from_args(args)
    search = _search(args, base)
    setup_logging(True)
    summary = run_search(search, base.out, TrainerTrial(base, search, args.nproc_per_node),
                         base.seed)
    return _said(summary, search, base.out, "model in")


def _said(summary: dict, search: Search, out, kept: str) -> int:
    best = summary["best"]
    if best is None:
        print(f"error: no trial completed; see {out}/trials/*.log", file=sys.stderr)
        return 1
    print(f"best trial {best['number']}: {search.objective} {best['value']:.4f} with "
          f"{best['params']}; {kept} {best['model']}; all trials in {out}/trials.csv")
    return 0


def _run_script(args) -> int:
    """`tune run --source`: each trial a local run of the script job (pipelines/tune/script.py)."""
    from kfvision.pipelines.jobs.config import JobConfig
    from kfvision.pipelines.script.assemble import script_parts, ship
    from kfvision.pipelines.script.manifest import NO_TRAINER
    from kfvision.pipelines.tune.script import ScriptTrial
    from kfvision.pipelines.tune.study import run_search
    from kfvision.trainer.train import setup_logging

    if args.out is None:
        raise InvalidParameterError("tune run --source needs --out DIR: the search's folder "
                                    "(its trials, study and best/).")
    search = _search(args)
    if search.early_stopping != "none":
        raise InvalidParameterError("--early-stopping median does not stop a script's trial on "
                                    "this machine yet (tune render passes it to Katib); drop it.")
    args.kind, args.name = "pytorchjob", "trial"  # the MLflow run's tags (tracking_env_of)
    cfg = JobConfig(name="trial", image="this-machine", train=NO_TRAINER, nodes=args.nodes,
                    procs_per_node=args.nproc_per_node)
    snap, script, transport = script_parts(args)
    print(f"source {args.source}: {len(snap.files)} file(s), sha256 {snap.sha256}; "
          f"{ship(snap, transport, None)}", file=sys.stderr)
    trial = ScriptTrial(cfg, script, snap, transport, search, args.out)
    setup_logging(True)
    summary = run_search(search, args.out, trial, NO_TRAINER.seed)
    return _said(summary, search, args.out, "model and outputs in")


def _render(args) -> int:
    import dataclasses

    from kfvision.pipelines.clients.k8s import to_yaml
    from kfvision.pipelines.jobs.fromflags import build_job, job_config_from_args
    from kfvision.pipelines.tune.experiment import TRIAL_KINDS, TRIAL_SUFFIX, build_experiment

    if _script_mode(args):
        return _render_script(args)
    cfg = job_config_from_args(args)
    search = _search(args, cfg.train)
    # rendered under a name as long as a trial's (<experiment>-<8 characters>): the pods' names
    # grow from it
    job, _ = build_job(args, dataclasses.replace(cfg, name=cfg.name + TRIAL_SUFFIX))
    experiment = build_experiment(job, TRIAL_KINDS[args.kind], search, cfg.name, cfg.namespace)
    text = to_yaml(experiment, "Rendered by `kfvision tune render` (docs/tuning.md): re-render "
                   "rather than edit.")
    _write(text, args.output, f"Experiment {cfg.name} ({search.trials} trials of {job['kind']})")
    return 0


def _write(text: str, output: str | None, what: str) -> None:
    write_rendered(text, output)
    if output not in (None, "-"):
        print(f"wrote {what} to {output}", file=sys.stderr)


def _render_script(args) -> int:
    """`tune render --source`: the script's job (as `job render --source` makes it) as the
    trial template, its source ConfigMap (if any) before the Experiment in the same file."""
    from kfvision.pipelines.script.assemble import script_job, yaml_text
    from kfvision.pipelines.tune.experiment import TRIAL_KINDS, TRIAL_SUFFIX, build_experiment
    from kfvision.pipelines.tune.script import SCRIPT

    search = _search(args)
    name = args.name
    args.name = name + TRIAL_SUFFIX  # see _render
    docs, said, header = script_job(args, then="the Experiment")
    experiment = build_experiment(docs[-1], TRIAL_KINDS[args.kind], search, name,
                                  args.namespace, SCRIPT)
    header = header.replace("Rendered by kfvision", "Rendered by `kfvision tune render`", 1)
    for line in said:
        print(line, file=sys.stderr)
    _write(yaml_text([*docs[:-1], experiment], header), args.output,
           f"Experiment {name} ({search.trials} trials of {docs[-1]['kind']} running your "
           "script)")
    return 0


def _read_experiment(path: str) -> tuple:
    """(the Experiment, [ConfigMap, ...]) of a file `tune render` wrote (a script's source
    ConfigMap comes before its Experiment)."""
    import yaml
    from kfvision.pipelines.jobs.errors import InvalidJobError
    from kfvision.pipelines.tune.katib_rules import validate_experiment

    source = "standard input" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        raise InvalidJobError(f"cannot read the Experiment {source}: {e}") from e
    kinds = [d.get("kind") if isinstance(d, dict) else None for d in docs]
    if kinds.count("Experiment") != 1 or kinds[-1] != "Experiment" or \
            set(kinds[:-1]) - {"ConfigMap"}:
        raise InvalidJobError(f"{source} is not one Katib Experiment, after its script's "
                              "ConfigMap if any (as `kfvision tune render` writes).")
    validate_experiment(docs[-1])
    return docs[-1], docs[:-1]


def _submit(args) -> int:
    experiment, config_maps = _read_experiment(args.manifest)
    return submit_command(args, experimentclient.client, experiment, config_maps)


def _status(args) -> int:
    api = experimentclient.client(args.namespace)
    api.report(args.name, api.get(args.name))
    api.trial_table(args.name)
    return 0


def _delete(args) -> int:
    api = experimentclient.client(args.namespace)
    api.delete(args.name)
    print(f"deleted Experiment {api.namespace}/{args.name} (and its trials)")
    return 0


def _cluster_verbs(verbs) -> None:
    add_submit(verbs, experimentclient.ExperimentClient, _submit, "create the Experiment on the "
               "cluster (re-attach if it exists)", manifest="Experiment YAML of `tune render` "
               "('-': standard input)")
    add_command(verbs, "status", _status, "an Experiment's state, best trial so far, and "
                "trials", name="Experiment name")
    add_command(verbs, "delete", _delete, "delete the Experiment (and its trials and their "
                "jobs)", name="Experiment name")


def register(subparsers, help: str) -> None:
    from kfvision.trainer.config import get_args_parser

    t = subparsers.add_parser("tune", help=help, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = t.add_subparsers(dest="verb", required=True, metavar="VERB")
    run = verbs.add_parser("run", parents=[get_args_parser(add_help=False)],
                           help="search on this machine (Optuna); --out is the search's folder",
                           formatter_class=HelpFormatter)
    _search_arguments(run)
    run.add_argument(NPROC_FLAG, type=int, default=1,
                     help="training processes per trial (torchrun when > 1)")
    # --- a user's own script: its flags and `job render`'s --nodes, declared there once ---
    from kfvision.pipelines.jobs.fromflags import JOB_OPTIONS

    add_flags(run.add_argument_group("your own script's trials"),
              [o for o in JOB_OPTIONS if o.name == "nodes"])
    add_script_flags(run)
    relax_trainer_paths(run)
    run.set_defaults(func=_run)
    render = verbs.add_parser("render", parents=[job_render_parser()], add_help=False,
                              conflict_handler="resolve",
                              help="write a Katib Experiment whose trials are `job render` jobs",
                              formatter_class=HelpFormatter)
    render.add_argument("-h", "--help", action="help", help="show this help message and exit")
    _search_arguments(render)  # --kind, --runtime, --runtime-kind: job render's (the trials')
    render.set_defaults(func=_render)
    _cluster_verbs(verbs)
