"""`kfvision job render --source DIR ...` and `kfvision job run`: a user's own script as a
PyTorchJob or TrainJob (docs/scripts.md). The flags are added to `job render` as one separate
group; everything after `--` reaches the script's argv unchanged.

    kfvision job render --name mnist --image IMAGE --nodes 2 --nproc-per-node 2 \\
        --source ./proj --entry train.py -o job.yaml -- --epochs 3 --lr 0.1
    kfvision job run-local job.yaml
"""

import argparse
import shlex
import sys
from pathlib import Path

from kfvision.pipelines.jobs.errors import InvalidJobError

# the built-in trainer's flags a script job takes too: its MLflow run (pipelines/script/track.py)
TRACKING = ("tracking_uri", "experiment")
SCRIPT_FLAGS = ("source", "entry", "module", "console_script", "requirements", "workdir",
                "launcher", "input", "collect", "output_uri", "source_store", "source_pvc",
                "include_secret", "env", "progress_total", "no_progress_reports",
                "no_check_requirements")


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
    from kfvision.pipelines.script.job import LAUNCHERS

    g = parser.add_argument_group("your own script (instead of the built-in trainer; "
                                  "docs/scripts.md)")
    g.add_argument("--source", metavar="DIR", help="folder of your training code, packed "
                   "into the job")
    g.add_argument("--entry", metavar="FILE", help="the script to run, relative to --source")
    g.add_argument("-m", "--module", metavar="NAME", help="or the module to run (python -m)")
    g.add_argument("--console-script", metavar="NAME", help="or a script of the source's "
                   "pyproject.toml [project.scripts]")
    g.add_argument("--requirements", metavar="FILE", help="pip requirements, relative to "
                   "--source (default: requirements.txt beside the entry)")
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


def check_mode(args) -> bool:
    """True for a script job; raises InvalidJobError for a mix of the two modes."""
    from dataclasses import fields

    from kfvision.trainer.config import TrainConfig

    trainer = [f.name for f in fields(TrainConfig) if getattr(args, f.name, None) is not None
               and (args.source is None or f.name not in TRACKING)]
    trainer += ["config"] if getattr(args, "config", None) else []
    if args.source is None:
        script = [n for n in SCRIPT_FLAGS if getattr(args, n)
                  and (n != "launcher" or args.launcher != "torchrun")]
        if script or args.script_args:
            raise InvalidJobError(f"--{(script or ['source'])[0].replace('_', '-')} and script "
                                  "arguments need --source DIR (your own script).")
        missing = [f"--{n}" for n in ("model", "train", "val", "out") if n not in trainer]
        if missing:
            raise InvalidJobError(f"the following arguments are required: {', '.join(missing)} "
                                  "(or --source DIR to run your own script).")
        return False
    if trainer:
        raise InvalidJobError(f"--{trainer[0].replace('_', '-')} is a flag of the built-in "
                              "trainer; with --source, give your script's own arguments after "
                              "--.")
    return True


def _script_config(args, snap):
    from kfvision.pipelines.script.entry import console_script, resolve
    from kfvision.pipelines.script.job import ScriptConfig

    module, call = args.module, None
    if args.console_script:
        if args.entry or args.module:
            raise InvalidJobError("give the script as one of --entry, --module or "
                                  "--console-script.")
        module, call = console_script(Path(args.source), args.console_script)
    start = resolve(snap.files, source=args.source, entry=args.entry, module=module,
                    requirements=args.requirements, workdir=args.workdir)
    if start["requirements"]:
        from kfvision.pipelines.script.requirements import check_file

        check_file(Path(args.source), start["requirements"], not args.no_check_requirements)
    from kfvision.pipelines.script.collect import check_collect

    return ScriptConfig(source=args.source, **start, args=tuple(args.script_args), call=call,
                        console_script=args.console_script if call else None,
                        collect=tuple(check_collect(d) for d in args.collect),
                        launcher=args.launcher, inputs=tuple(args.input),
                        output_uri=args.output_uri,
                        env=(*args.env, *tracking_env(args, {n for n, _ in args.env}),
                             *progress_env(args)))


def progress_env(args) -> tuple:
    """((name, value), ...) of --progress-total and --no-progress-reports: the variables the
    boot, run-local and `job status` read (pipelines/jobs/progress.py)."""
    from kfvision.pipelines.jobs.metriclines import parse_metrics
    from kfvision.pipelines.jobs.progress import (
        PROGRESS_REPORTS,
        PROGRESS_TOTAL,
        REPORTS_OFF,
        check_totals,
    )

    pairs = []
    if args.progress_total:
        given = {n: parse_metrics(f"x={v}").get("x") for n, v in args.progress_total}
        bad = next((f"{n}={v}" for n, v in args.progress_total if given[n] is None), None)
        if bad:
            raise InvalidJobError(f"--progress-total {bad}: the total is not a number.")
        check_totals(given)
        pairs.append((PROGRESS_TOTAL, " ".join(f"{n}={v:g}" for n, v in given.items())))
    if args.no_progress_reports:
        pairs.append((PROGRESS_REPORTS, REPORTS_OFF))
    return tuple(pairs)


def tracking_env(args, given: set) -> tuple:
    """((name, value), ...) that turn the script's MLflow run on in its pods: --tracking-uri
    (else MLFLOW_TRACKING_URI here) and --experiment, forwarded as the train step forwards them
    (kfvision.pipelines.flow.steps.train.tracking_env: no credentials in the file), with the job's
    kind and
    name as tags; none that --env sets itself."""
    import os

    from kfvision.pipelines.flow.steps.train import tracking_env as forwarded
    from kfvision.pipelines.jobs.kinds import named
    from kfvision.trainer import upstream

    environ = dict(os.environ)
    if getattr(args, "tracking_uri", None):
        environ[upstream.MLFLOW_TRACKING_URI] = args.tracking_uri
    if getattr(args, "experiment", None):
        environ[upstream.MLFLOW_EXPERIMENT_NAME] = args.experiment
    pairs = forwarded(environ, kind=named(args.kind).kind, name=args.name, run_id="", local=False,
                      out=sys.stderr)
    return tuple((n, v) for n, v in pairs if n not in given)


def ship(snap, transport, output: str | None) -> str:
    """Put the snapshot where `transport` says (s3: upload unless there; pvc: write it here
    when the folder is, else beside the YAML); a line saying what was done."""
    if transport.how == "configmap":
        return "in the ConfigMap beside the job"
    if transport.how == "s3":
        import tempfile

        from kfvision.pipelines.clients import s3

        if s3.head(transport.where) is not None:
            return f"at {transport.where} (already there)"
        bucket, key = s3.split_uri(transport.where)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "source.tar.gz"
            path.write_bytes(snap.data)
            s3.upload(path, bucket, key)
        return f"uploaded to {transport.where}"
    target = Path(transport.where)
    if not target.parent.is_dir():
        target = Path(output or ".").parent / target.name
        target.write_bytes(snap.data)
        return (f"written to {target}: copy it to {transport.where} on the claim before the "
                "job starts")
    if not target.is_file():
        target.write_bytes(snap.data)
    return f"at {transport.where}"


def made_here(args) -> list:
    """What kfvision writes for this job (its YAML, its local run's folder): never packed."""
    made = [getattr(args, "output", None), getattr(args, "log_dir", None)]
    if getattr(args, "submit", None) is not None and not args.log_dir:  # `job run`'s default
        made.append(Path("build") / "jobs" / args.name)
    return [Path(p) for p in made if p not in (None, "-")]


def script_parts(args) -> tuple:
    """(snapshot, ScriptConfig, Transport) of the script flags: the source packed and checked;
    nothing shipped yet."""
    from kfvision.pipelines.script.job import choose_transport
    from kfvision.pipelines.script.pack import pack

    snap = pack(args.source, include=args.include_secret, exclude=made_here(args))
    script = _script_config(args, snap)
    return snap, script, choose_transport(snap, args.source_store, args.source_pvc)


def script_job(args, build_kind, then: str = "the job") -> tuple:
    """(docs: [ConfigMap (if any), job], lines to tell the user, the YAML header's text) of
    `job render --source`; the snapshot shipped where its transport says. `then`: what the
    header says the file creates after the ConfigMap."""
    from kfvision.pipelines.jobs.config import JobConfig
    from kfvision.pipelines.script.job import (
        NO_TRAINER,
        build_script_job,
        encoded_size,
        fits_client_side_apply,
    )
    from kfvision.trainer.options import options_of

    JOB_OPTIONS = options_of(JobConfig)  # noqa: N806 (as pipelines/cli/job.py names them)
    given = {o.name: getattr(args, o.name) for o in JOB_OPTIONS}
    given.update({o.name: tuple(given[o.name]) for o in JOB_OPTIONS if o.many})
    cfg = JobConfig(train=NO_TRAINER, **given)
    if args.kind == "pytorchjob" and (args.runtime or args.runtime_kind):
        build_kind(args, cfg)  # the built-in path's refusal, worded once
    snap, script, transport = script_parts(args)
    from kfvision.pipelines.jobs.kinds import named
    from kfvision.pipelines.jobs.trainjob.build import RuntimeRef

    docs = build_script_job(cfg, script, snap, transport, kind=named(args.kind),
                            runtime=RuntimeRef.from_flags(args.runtime, args.runtime_kind))
    said = [f"source {args.source}: {len(snap.files)} file(s), {snap.size:,} bytes packed "
            f"({encoded_size(snap):,} as base64), sha256 {snap.sha256}; "
            f"{ship(snap, transport, getattr(args, 'output', None))}"]
    said.append(f"requirements: {script.requirements or 'none'}" + (
        " (at the source's root)" if script.requirements == "requirements.txt" and
        script.entry and "/" in script.entry else ""))
    if snap.left_out:
        said.append(f"left out as secrets: {', '.join(snap.left_out)} (--include-secret PATH "
                    "packs one anyway)")
    if not cfg.volumes:
        said.append("note: no --pvc, so the checkpoint directory does not outlive a restarted "
                    "pod")
    if not script.output_uri:
        said.append("note: no --output-uri, so the model directory stays in the pod")
    apply = "kubectl apply -f"
    if docs[0]["kind"] == "ConfigMap" and not fits_client_side_apply(docs[0]):
        apply = "kubectl apply --server-side -f"
        said.append(f"note: the ConfigMap ({encoded_size(snap) // 1024} KiB) is too big for "
                    "client-side `kubectl apply` (its last-applied annotation may hold 256 KiB):"
                    " use `kubectl apply --server-side -f`, `kubectl create -f` or `kfvision "
                    "job submit`")
    header = (f"Rendered by kfvision from your own script: `{apply}` this file creates "
              f"the ConfigMap (if any) first, then {then}.\n"
              f"source {args.source} (sha256 {snap.sha256}), {script.target} "
              f"{shlex.join(script.args)}".rstrip())
    return docs, said, header


def yaml_text(docs: list, header: str) -> str:
    """The documents as one YAML file, `header` as its first comment."""
    from kfvision.pipelines.clients.k8s import to_yaml

    return to_yaml(docs[0], header) + "".join("---\n" + to_yaml(d) for d in docs[1:])


def render_script(args, build_kind) -> tuple:
    """(YAML text, the job dict, lines to tell the user) of `job render --source`."""
    docs, said, header = script_job(args, build_kind)
    return yaml_text(docs, header), docs[-1], said


def write_rendered(text: str, output: str | None) -> None:
    if output in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text, encoding="utf-8")


def add_run(sub, job_options, add_kind_flags, func) -> None:
    """`kfvision job run --source ...`: render, say where the YAML went, then run it here or
    submit it."""
    from kfvision.trainer.options import HelpFormatter, add_flags

    r = sub.add_parser("run", formatter_class=HelpFormatter, allow_abbrev=False,
                       help="your own script in one step: render, then run-local (or submit)",
                       description="Render a job for your own script (as `job render --source`),"
                       " write it to -o (default build/jobs/NAME.yaml), then run it on this "
                       "machine as `job run-local` does, or with --submit on the cluster.")
    g = r.add_argument_group("job")
    add_flags(g, job_options)
    add_kind_flags(g)
    g.add_argument("-o", "--output", help="YAML file to write (default: build/jobs/NAME.yaml)")
    add_script_flags(r)
    from kfvision.trainer.config import TrainConfig
    from kfvision.trainer.options import options_of

    t = r.add_argument_group("the script's MLflow run (as `job render --source` takes them)")
    add_flags(t, [o for o in options_of(TrainConfig) if o.name in TRACKING])
    w = r.add_argument_group("where it runs")
    w.add_argument("--submit", action="store_true", help="submit to the cluster instead of "
                   "running here")
    w.add_argument("--log-dir", help="here: per-replica logs (default: build/jobs/NAME)")
    w.add_argument("--quiet", action="store_true", help="here: logs to files only")
    from kfvision.pipelines.cli.cluster import add_cluster_flags, waiting_flags
    from kfvision.pipelines.jobs.cluster import JobClient

    add_cluster_flags(r.add_argument_group("with --submit (its namespace: --namespace above)"),
                      waiting_flags(JobClient))
    r.set_defaults(func=func)


def run_args(args) -> argparse.Namespace:
    """The `run-local` / `submit` arguments of a `job run` (their defaults, its choices)."""
    if args.source is None:
        raise InvalidJobError("kfvision job run needs --source DIR (and --entry or --module): "
                              "it runs your own script; the built-in trainer renders with "
                              "`kfvision job render`.")
    return argparse.Namespace(manifest=args.output, namespace=args.namespace, wait=args.wait,
                              timeout=args.timeout, keep_on_timeout=args.keep_on_timeout,
                              poll=args.poll, no_logs=False, log_dir=args.log_dir,
                              quiet=args.quiet, grace=30.0, fault=[])


def add_download(sub) -> None:
    """`kfvision job download NAME PATH`: a file or folder of a script job's outputs
    (pipelines/script/outputs.py)."""
    from kfvision.pipelines.cli.cluster import add_command

    dl = add_command(sub, "download", _download, "fetch a file or folder of a finished script "
                     "job's outputs (model/..., outputs/...)", name="job name",
                     description="Fetch PATH (model/... or outputs/...) of what a script job "
                     "kept after success: from its local run's folder, else (or with -n) from "
                     "the --output-uri (s3://) the job on the cluster carries (docs/scripts.md).")
    dl.add_argument("path", help="model/FILE, outputs/FILE, or a folder such as outputs")
    dl.add_argument("--out", default=".", help="folder to write it into (default: .)")
    dl.add_argument("--log-dir", help="the local run's folder (default: build/jobs/NAME)")


def _download(args) -> int:
    from kfvision.pipelines.clients.k8s import KubernetesError
    from kfvision.pipelines.jobs.errors import JobOutputsError
    from kfvision.pipelines.script import outputs

    path = outputs.check_path(args.path)
    log_dir = Path(args.log_dir or Path("build") / "jobs" / args.name)
    work = None if args.namespace else outputs.local_run(args.name, log_dir)
    if work is not None:
        got = outputs.from_local(work, path, Path(args.out))
        print(outputs.empty_note(work, path, got) or
              f"downloaded {path} of job {args.name} from its local run in {log_dir} to {got}")
        return 0
    from kfvision.pipelines.jobs.cluster import attach, connect
    from kfvision.pipelines.jobs.podstatus import job_state

    try:
        client = attach(connect(args.namespace), args.name)
    except KubernetesError as e:
        if args.namespace or e.status not in (None, 404):
            raise
        raise JobOutputsError(f"job {args.name} has no local run in {log_dir} (--log-dir), and "
                              f"the cluster has none either: {e}") from e
    job = client.get(args.name)
    what = f"{client.kind.kind} {client.namespace}/{args.name}"
    uri = outputs.output_uri(job, what)
    state, _ = job_state(job)
    if state != client.kind.succeeded:
        raise JobOutputsError(f"{what} is {state}, not {client.kind.succeeded}: node 0 copies "
                              f"its outputs to {uri} after success.")
    got = outputs.from_uri(uri, path, Path(args.out))
    print(f"downloaded {path} of {what} from {uri} to {got}")
    return 0
