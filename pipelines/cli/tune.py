"""`kfvision tune run | render | submit | status | delete`: hyperparameter search, on this machine
(Optuna) or as a Katib Experiment whose trials are the jobs `kfvision job render` makes. See
docs/tuning.md."""

import argparse
import sys
from pathlib import Path

from pipelines.cli.train import NPROC_FLAG
from pipelines.tune.experiment import Search
from pipelines.tune.space import check_space
from trainer.options import ArgumentParser, HelpFormatter, add_flags, options_of

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


def _search(args, base) -> Search:
    # more failures allowed than trials means "never give up": Katib wants it said as <= trials
    max_failed = min(args.max_failed, args.trials)
    given = {o.name: getattr(args, o.name) for o in options_of(Search)}
    search = Search(**{**given, "params": tuple(args.params), "max_failed": max_failed})
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

    from pipelines.cli.job import build_job, job_config_from_args
    from pipelines.clients.k8s import to_yaml
    from pipelines.tune.experiment import TRIAL_KINDS, build_experiment

    cfg = job_config_from_args(args)
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


def _read_experiment(path: str) -> dict:
    import yaml

    from pipelines.jobs.errors import InvalidJobError
    from pipelines.tune.katib_rules import validate_experiment

    source = "standard input" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        raise InvalidJobError(f"cannot read the Experiment {source}: {e}") from e
    if len(docs) != 1 or not isinstance(docs[0], dict) or docs[0].get("kind") != "Experiment":
        raise InvalidJobError(f"{source} is not one Katib Experiment (as `kfvision tune render` "
                              "writes).")
    validate_experiment(docs[0])
    return docs[0]


def _client(args, experiment: dict | None = None):
    from pipelines.jobs.errors import InvalidJobError
    from pipelines.tune import cluster

    given = (experiment or {}).get("metadata", {}).get("namespace")
    if args.namespace and given and args.namespace != given:
        raise InvalidJobError(f"--namespace {args.namespace} differs from the Experiment's "
                              f"metadata.namespace {given}; drop one of them.")
    return cluster.client(args.namespace or given)


def _submit(args) -> int:
    from pipelines.tune.cluster import submit

    experiment = _read_experiment(args.experiment)
    api = _client(args, experiment)
    try:
        submit(api, experiment, wait=args.wait, timeout_s=args.timeout, poll_s=args.poll)
    except KeyboardInterrupt:
        print(f"stopped waiting; the Experiment goes on (kfvision tune status "
              f"{experiment['metadata']['name']} -n {api.namespace})", file=sys.stderr)
        return 130
    return 0


def _status(args) -> int:
    api = _client(args)
    api.report(args.name, api.get(args.name))
    api.trial_table(args.name)
    return 0


def _delete(args) -> int:
    api = _client(args)
    api.delete(args.name)
    print(f"deleted Experiment {api.namespace}/{args.name} (and its trials)")
    return 0


def _cluster_verbs(verbs) -> None:
    fmt, ns_help = HelpFormatter, "namespace (default: the current context's)"
    s = verbs.add_parser("submit", formatter_class=fmt,
                         help="create the Experiment on the cluster (re-attach if it exists)")
    s.add_argument("experiment", help="Experiment YAML of `tune render` ('-': standard input)")
    s.add_argument("-n", "--namespace", help="namespace (default: the Experiment's, else the "
                   "current context's)")
    s.add_argument("--wait", action="store_true", help="wait for Succeeded/Failed, then print "
                   "the best trial's parameters and objective")
    s.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="stop waiting after this long (the Experiment goes on)")
    s.add_argument("--poll", type=float, default=30.0, help="seconds between status checks")
    s.set_defaults(func=_submit)
    st = verbs.add_parser("status", formatter_class=fmt,
                          help="an Experiment's state, best trial so far, and trials")
    st.add_argument("name", help="Experiment name")
    st.add_argument("-n", "--namespace", help=ns_help)
    st.set_defaults(func=_status)
    d = verbs.add_parser("delete", formatter_class=fmt,
                         help="delete the Experiment (and its trials and their jobs)")
    d.add_argument("name", help="Experiment name")
    d.add_argument("-n", "--namespace", help=ns_help)
    d.set_defaults(func=_delete)


def _job_render_parser() -> argparse.ArgumentParser:
    """`kfvision job render`'s parser: the job and training flags, declared there once."""
    from pipelines.cli import job

    sub = ArgumentParser(add_help=False).add_subparsers()
    job.add_render(sub)
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
    run.add_argument(NPROC_FLAG, type=int, default=1,
                     help="training processes per trial (torchrun when > 1)")
    run.set_defaults(func=_run)
    render = verbs.add_parser("render", parents=[_job_render_parser()], add_help=False,
                              conflict_handler="resolve",
                              help="write a Katib Experiment whose trials are `job render` jobs",
                              formatter_class=HelpFormatter)
    render.add_argument("-h", "--help", action="help", help="show this help message and exit")
    _search_arguments(render)  # --kind, --runtime, --runtime-kind: job render's (the trials')
    render.set_defaults(func=_render)
    _cluster_verbs(verbs)
