"""`kfvision job render | run-local | submit | logs | delete | status | list`: the PyTorchJob and
TrainJob command line. logs, delete, status, list and download ask the job's backend, a local
run's or the cluster's alike (pipelines/jobs/backends.py)."""

import argparse
import shlex
import signal
import sys
from pathlib import Path

from kfvision.pipelines.cli.clusterargs import TARGET, add_command, add_submit, submit_command
from kfvision.pipelines.cli.flags import (
    RENDER_DESCRIPTION,
    job_render_parser,
    run_args,
    write_rendered,
)
from kfvision.pipelines.clients.k8s import to_yaml
from kfvision.pipelines.clients.s3 import is_s3
from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.faults import Fault
from kfvision.pipelines.jobs.fromflags import build_job, job_config_from_args, render_argv
from kfvision.pipelines.jobs.jobclient import JobClient
from kfvision.pipelines.jobs.signals import STOP
from kfvision.pipelines.script.assemble import check_mode, render_script
from kfvision.trainer.options import HelpFormatter

EPILOG = """\
the same job, three ways:
  kfvision job render --name digits --image IMAGE --nodes 2 --nproc-per-node 2 \\
      --model M --train T --val V --out O -o job.yaml
  kfvision job run-local job.yaml                 # on this machine, as the operator would
  kfvision job submit job.yaml --wait             # on the cluster of the current kubeconfig
  kubectl apply -f job.yaml                       # by hand
See docs/jobs.md (and manifests/rbac.yaml for the service account's permissions).
"""


def _render(args) -> int:
    if check_mode(args):
        return _render_script(args)
    cfg = job_config_from_args(args)
    job, kind_argv = build_job(args, cfg)
    if not args.no_check_store:  # before anything is written: a missing input is its error
        from kfvision.pipelines.jobs.storejob import check_store

        check_store(cfg.train)
    header = ("Rendered by kfvision; edit the command, not this file:\n"
              f"kfvision job render {shlex.join(kind_argv + render_argv(cfg))}")
    write_rendered(to_yaml(job, header), args.output)
    if args.output not in (None, "-"):
        print(f"wrote {job['kind']} {cfg.name} ({cfg.nodes} node(s) x {cfg.nproc} process(es), "
              f"{cfg.gpus_per_node} GPU(s) per node) to {args.output}", file=sys.stderr)
    mounts = [v.mount.rstrip("/") + "/" for v in cfg.volumes]
    if mounts and not is_s3(cfg.train.out) and not any(cfg.train.out.startswith(m)
                                                       for m in mounts):
        print(f"warning: --out {cfg.train.out} is not under a --pvc mount; the trained model "
              "would be lost with the Master's pod.", file=sys.stderr)
    return 0


def add_render(sub) -> None:
    r = sub.add_parser("render", parents=[job_render_parser()],
                       help="write the PyTorchJob (or TrainJob) YAML of a training run",
                       description=RENDER_DESCRIPTION, formatter_class=HelpFormatter)
    r.set_defaults(func=_render)


def _render_script(args) -> int:
    text, job, said = render_script(args)
    write_rendered(text, args.output)
    where = "standard output" if args.output in (None, "-") else args.output
    for line in said:
        print(line, file=sys.stderr)
    print(f"wrote {job['kind']} {job['metadata']['name']} running your script to {where}",
          file=sys.stderr)
    return 0


def _fault(text: str) -> Fault:
    try:
        return Fault.parse(text)
    except InvalidJobError as e:  # argparse shows this message, not "invalid value"
        raise argparse.ArgumentTypeError(str(e)) from e


@STOP  # SIGINT and SIGTERM heard from here on, whatever this process inherited (signals.py)
def _run_local(args) -> int:
    from kfvision.pipelines.jobs.kinds import read_manifest
    from kfvision.pipelines.jobs.render import run_local

    job, config_maps = read_manifest(args.manifest)  # ConfigMaps: a user's script's source
    name = job["metadata"]["name"]
    log_dir = Path(args.log_dir or Path("build") / "jobs" / name)
    from kfvision.pipelines.script.snapshot import tag_made

    log_dir.mkdir(parents=True, exist_ok=True)
    tag_made(log_dir)  # a source folder that holds it never packs it
    print(f"running {job['kind']} {name} locally (image {_images(job)} stands in by this "
          f"machine's programs); logs in {log_dir}/", file=sys.stderr)
    try:  # --grace is a PyTorchJob's (a TrainJob's nodes must all succeed)
        result = run_local(job, log_dir, source=args.manifest, quiet=args.quiet,
                           grace_s=args.grace, faults=args.fault, config_maps=config_maps,
                           sandbox=False if args.no_sandbox else None)
    except KeyboardInterrupt:
        return _stopped(name)  # run_local raised Interrupted once every process was stopped
    print(f"job {name} succeeded in {result.seconds:.1f} s ({result.restarts} restart(s)); "
          f"logs in {log_dir}/", file=sys.stderr)
    return 0


def _stopped(name: str) -> int:
    """Say that a signal stopped job `name`; its exit code: 128 + the first signal (130, 143)."""
    signals = STOP.received or [signal.SIGINT]
    how = "interrupted" if signals[0] == signal.SIGINT else (
        f"terminated ({signal.Signals(signals[0]).name})")
    if len(signals) > 1:
        print(f"{how} twice: killed every process of job {name} at once (SIGKILL)",
              file=sys.stderr)
    else:
        print(f"{how}: stopped every process of job {name}", file=sys.stderr)
    return 128 + signals[0]


def _images(job: dict) -> str:
    if job["kind"] == "TrainJob":
        return job["spec"]["trainer"].get("image", "(the runtime's)")
    specs = job["spec"]["pytorchReplicaSpecs"].values()
    return ", ".join(sorted({c["image"] for s in specs for c in s["template"]["spec"]["containers"]
                             if c.get("name") == "pytorch"}))


def _submit(args) -> int:
    from kfvision.pipelines.jobs import jobclient
    from kfvision.pipelines.jobs.kinds import kind_of, read_manifest

    job, config_maps = read_manifest(args.manifest)  # ConfigMaps: a user's script's source
    return submit_command(args, lambda ns: jobclient.connect(ns, kind=kind_of(job)), job,
                          list(config_maps.values()), logs=not args.no_logs)


def _logs(args) -> int:
    from kfvision.pipelines.jobs.backends import pick

    if args.all and args.replica:
        raise InvalidJobError("--all shows every replica; drop --replica (or --all).")
    backend = pick(args.name, args.namespace, args.log_dir)
    if args.follow:
        backend.follow(args.name, write=lambda line: print(line, flush=True),
                       note=lambda line: print(line, file=sys.stderr, flush=True),
                       replica=args.replica, all=args.all, poll_s=args.poll)
        return 0
    for line in backend.logs(args.name, args.replica, all=args.all, tail=args.tail,
                             previous=args.previous):
        print(line)
    return 0


def _delete(args) -> int:
    from kfvision.pipelines.jobs.backends import pick

    print(f"deleted {pick(args.name, args.namespace, args.log_dir).delete(args.name)}")
    return 0


def register(subparsers, help: str) -> None:
    """Add `kfvision job ...` to the `kfvision` command line's subparsers."""
    job = subparsers.add_parser(
        "job", help=help,
        description="Train as a Kubeflow PyTorchJob (Training Operator v1.9) or TrainJob "
        "(Kubeflow Trainer v2).", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = job.add_subparsers(dest="job_command", required=True, metavar="ACTION")
    add_render(sub)
    r = sub.add_parser("run-local", formatter_class=HelpFormatter,
                       help="run a PyTorchJob or TrainJob YAML on this machine, as the "
                       "cluster would")
    r.add_argument("manifest", help="PyTorchJob or TrainJob YAML ('-': standard input)")
    r.add_argument("--log-dir", help="per-replica logs (default: build/jobs/NAME)")
    r.add_argument("--quiet", action="store_true", help="logs to files only, not the terminal")
    r.add_argument("--grace", type=float, default=30.0,
                   help="seconds Workers may take to finish after the Master succeeded")
    r.add_argument("--fault", type=_fault, action="append", default=[],
                   metavar="TARGET:SIGNAL:PATTERN",
                   help="fault drill (repeatable): on a log line matching PATTERN, send SIGNAL "
                   "to TARGET")
    from kfvision.pipelines.cli.flags import add_no_sandbox

    add_no_sandbox(r)
    r.set_defaults(func=_run_local)
    s = add_submit(sub, JobClient, _submit, "create the job on the cluster (re-attach if it "
                   "exists)", manifest="PyTorchJob or TrainJob YAML ('-': standard input)")
    s.add_argument("--no-logs", action="store_true", help="do not stream the log of rank 0")
    lg = add_command(sub, "logs", _logs, "print a replica's log", name="job name",
                     flags=(*TARGET, "poll"))  # --poll: for --follow
    lg.add_argument("--replica", help="master-0, worker-0, ... (PyTorchJob) or node-0-0, "
                    "node-0-1, ... (TrainJob); default: rank 0's")
    lg.add_argument("--all", action="store_true", help="every pod, interleaved, each line "
                    "prefixed [node/rank]")
    lg.add_argument("-f", "--follow", action="store_true", help="wait through Pending, then "
                    "stream until the job ends")
    lg.add_argument("--tail", type=int, help="only the last N lines (of each pod)")
    lg.add_argument("--previous", action="store_true", help="the log of the container before "
                    "its last restart")
    lg.add_argument("--log-dir", help="a local run's folder (default: build/jobs/NAME)")
    d = add_command(sub, "delete", _delete, "delete the job and its pods (a local run: stop it, "
                    "remove its folder)", name="job name")
    d.add_argument("--log-dir", help="a local run's folder (default: build/jobs/NAME)")
    # --- a user's own script in one step, and its outputs: pipelines/cli/jobscript.py ---
    from kfvision.pipelines.cli.jobscript import add_download, add_run

    add_run(sub, _run_script)
    add_download(sub)
    # --- where jobs stand, local and on the cluster: pipelines/cli/jobstatus.py ---
    from kfvision.pipelines.cli.jobstatus import add_status

    add_status(sub)


def _run_script(args) -> int:
    if args.source is not None:
        check_mode(args)
    if not args.output:
        from kfvision.pipelines.script.snapshot import tag_made

        (Path("build") / "jobs").mkdir(parents=True, exist_ok=True)
        tag_made(Path("build") / "jobs")  # never packed by a `--source .`
    args.output = args.output or str(Path("build") / "jobs" / f"{args.name}.yaml")
    then = run_args(args)
    _render_script(args)
    return _submit(then) if args.submit else _run_local(then)

