"""`kfvision job run` (a user's own script in one step: render, then run here or submit) and
`kfvision job download` (a file or folder of a script job's outputs). The script's flags are
pipelines/cli/flags.py's; its job is assembled by pipelines/script/assemble.py (docs/scripts.md).

    kfvision job run --name mnist --image IMAGE --source ./proj --entry train.py -- --epochs 3
    kfvision job download mnist outputs/metrics.json
"""

from pathlib import Path

from kfvision.pipelines.cli.clusterargs import add_cluster_flags, add_command, waiting_flags
from kfvision.pipelines.cli.flags import add_kind_flags, add_no_sandbox, add_script_flags
from kfvision.pipelines.jobs.fromflags import JOB_OPTIONS
from kfvision.pipelines.script.assemble import TRACKING


def add_run(sub, func) -> None:
    """`kfvision job run --source ...`: render, say where the YAML went, then run it here or
    submit it."""
    from kfvision.trainer.options import HelpFormatter, add_flags

    r = sub.add_parser("run", formatter_class=HelpFormatter, allow_abbrev=False,
                       help="your own script in one step: render, then run-local (or submit)",
                       description="Render a job for your own script (as `job render --source`),"
                       " write it to -o (default build/jobs/NAME.yaml), then run it on this "
                       "machine as `job run-local` does, or with --submit on the cluster.")
    g = r.add_argument_group("job")
    add_flags(g, JOB_OPTIONS)
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
    add_no_sandbox(w)
    from kfvision.pipelines.jobs.jobclient import JobClient

    add_cluster_flags(r.add_argument_group("with --submit (its namespace: --namespace above)"),
                      waiting_flags(JobClient))
    r.set_defaults(func=func)


def add_download(sub) -> None:
    """`kfvision job download NAME PATH`: a file or folder of a script job's outputs
    (pipelines/jobs/outputs.py)."""
    dl = add_command(sub, "download", _download, "fetch a file or folder of a finished script "
                     "job's outputs (model/..., outputs/...)", name="job name",
                     description="Fetch PATH (model/... or outputs/...) of what a script job "
                     "kept after success: from its local run's folder, else (or with -n) from "
                     "the --output-uri (s3://) the job on the cluster carries (docs/scripts.md).")
    dl.add_argument("path", help="model/FILE, outputs/FILE, or a folder such as outputs")
    dl.add_argument("--out", default=".", help="folder to write it into (default: .)")
    dl.add_argument("--log-dir", help="the local run's folder (default: build/jobs/NAME)")


def _download(args) -> int:
    from kfvision.pipelines.jobs.backends import pick
    from kfvision.pipelines.jobs.outputs import check_path
    from kfvision.pipelines.script.jobmodel import record_download

    path = check_path(args.path)
    backend = pick(args.name, args.namespace, args.log_dir)
    got, source, note = backend.download(args.name, path, Path(args.out))
    record_download(Path(args.out), got, job=args.name, path=path, where=source)
    print(note or f"downloaded {path} of job {args.name} from {source} to {got}")
    return 0
