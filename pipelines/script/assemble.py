"""A user's own script as a job, from the command line's flags (docs/scripts.md): which mode the
flags ask for (`check_mode`), the source packed and its ScriptConfig (`script_parts`), the
snapshot shipped where its transport says (`ship`), and the rendered documents with what to tell
the user (`script_job`). `kfvision job render|run --source`, `tune run|render --source` and
`pipeline submit` (a script's source uploaded) call these; the manifests themselves are
pipelines/script/manifest.py's, pure.
"""

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


def script_config(args, snap):
    """The ScriptConfig of the script flags, resolved against the snapshot's files."""
    from kfvision.pipelines.script.collect import check_collect
    from kfvision.pipelines.script.entry import console_script, resolve
    from kfvision.pipelines.script.manifest import ScriptConfig

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
    return ScriptConfig(source=args.source, **start, args=tuple(args.script_args), call=call,
                        console_script=args.console_script if call else None,
                        collect=tuple(check_collect(d) for d in args.collect),
                        launcher=args.launcher, inputs=tuple(args.input),
                        output_uri=args.output_uri,
                        env=(*args.env, *tracking_env_of(args, {n for n, _ in args.env}),
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


def tracking_env_of(args, given: set) -> tuple:
    """((name, value), ...) that turn the script's MLflow run on in its pods: --tracking-uri
    (else MLFLOW_TRACKING_URI here) and --experiment, forwarded as the train step forwards them
    (kfvision.pipelines.jobs.mlflowenv.tracking_env: no credentials in the file), with the job's
    kind and name as tags; none that --env sets itself."""
    import os

    from kfvision.pipelines.jobs.kinds import named
    from kfvision.pipelines.jobs.mlflowenv import tracking_env
    from kfvision.trainer import upstream

    environ = dict(os.environ)
    if getattr(args, "tracking_uri", None):
        environ[upstream.MLFLOW_TRACKING_URI] = args.tracking_uri
    if getattr(args, "experiment", None):
        environ[upstream.MLFLOW_EXPERIMENT_NAME] = args.experiment
    pairs = tracking_env(environ, kind=named(args.kind).kind, name=args.name, run_id="",
                         local=False, out=sys.stderr)
    return tuple((n, v) for n, v in pairs if n not in given)


def ship(snap, transport, output: str | None) -> str:
    """Put the snapshot where `transport` says (s3: upload unless there; pvc: write it here
    when the folder is, else beside the YAML); a line saying what was done."""
    if transport.how == "configmap":
        return "in the ConfigMap beside the job"
    if transport.how == "s3":
        import tempfile

        from kfvision.pipelines.clients import s3, s3put

        if s3.head(transport.where) is not None:
            return f"at {transport.where} (already there)"
        bucket, key = s3.split_uri(transport.where)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "source.tar.gz"
            path.write_bytes(snap.data)
            s3put.upload(path, bucket, key)
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
    from kfvision.pipelines.script.manifest import choose_transport
    from kfvision.pipelines.script.snapshot import pack

    snap = pack(args.source, include=args.include_secret, exclude=made_here(args))
    script = script_config(args, snap)
    return snap, script, choose_transport(snap, args.source_store, args.source_pvc)


def script_job(args, then: str = "the job") -> tuple:
    """(docs: [ConfigMap (if any), job], lines to tell the user, the YAML header's text) of
    `job render --source`; the snapshot shipped where its transport says. `then`: what the
    header says the file creates after the ConfigMap."""
    from kfvision.pipelines.jobs.config import JobConfig
    from kfvision.pipelines.jobs.fromflags import build_job, job_options_of
    from kfvision.pipelines.script.manifest import (
        NO_TRAINER,
        build_script_job,
        encoded_size,
        fits_client_side_apply,
    )

    cfg = JobConfig(train=NO_TRAINER, **job_options_of(args))
    if args.kind == "pytorchjob" and (args.runtime or args.runtime_kind):
        build_job(args, cfg)  # the built-in path's refusal, worded once
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


def render_script(args) -> tuple:
    """(YAML text, the job dict, lines to tell the user) of `job render --source`."""
    docs, said, header = script_job(args)
    return yaml_text(docs, header), docs[-1], said
