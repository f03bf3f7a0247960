"""`kfvision job status NAME [--watch]` and `kfvision job list`: where jobs stand, local runs and
the cluster's alike (docs/scripts.md, "Seeing how far it has come"), as the job's backend says
(pipelines/jobs/backends.py); the words and the bar are drawn here.

    kfvision job status demo             # a local run (build/jobs/demo), else the cluster's job
    kfvision job status demo -n team-a   # the cluster's
    kfvision job list [-n team-a]        # local runs under build/jobs, or the cluster's jobs

    demo: PyTorchJob, local run in build/jobs/demo
      phase     Running for 1 min 5 s
      shape     2 nodes x 2 processes
      progress  [########------------]  40%  4 of 10 epochs done, about 1 min 20 s left
      metrics   epoch=3 loss=0.412 acc=0.91  (2 s ago)

A local run is what `job run-local` and `job run` record as they run (pipelines/jobs/
localstatus.py); a job on a cluster is read as pipelines/jobs/jobstatus.py says.
"""

import json
import sys
import time

from kfvision.pipelines.jobs.backends import LOG_ROOT

BAR = 20  # characters of the progress bar


def duration(seconds: float) -> str:
    """`45 s`, `1 min 20 s`, `2 h 3 min`."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _number(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def progress_line(progress: dict) -> str | None:
    """The bar, percentage, position and time left; None without a position or percentage."""
    percent, position = progress.get("percent"), progress.get("position")
    if percent is None and position is None:
        return None
    parts = []
    if percent is not None:
        filled = round(BAR * percent / 100)
        parts.append(f"[{'#' * filled}{'-' * (BAR - filled)}] {percent:3d}%")
    total = progress.get("total")
    if position is not None and total is not None and progress.get("done") is not None:
        parts.append(f"{_number(progress['done'])} of {_number(total)} {position}s done")
    elif position is not None and total is not None:  # as a TrainJob's status reports it
        parts.append(f"{position} {_number(progress.get('value'))} of {_number(total)}")
    elif position is not None:
        parts.append(f"{position} {_number(progress.get('value'))} (the total is unknown: "
                     "print it, or render with --progress-total)")
    eta = progress.get("eta_s")
    if eta and percent != 100:
        parts.append(f"about {duration(eta)} left")
    return "  ".join(parts[:1]) + ("  " + ", ".join(parts[1:]) if parts[1:] else "")


def status_text(view: dict, now: float) -> str:
    """The lines `kfvision job status` prints for a view (pipelines/jobs/jobstatus.py)."""
    lines = [f"{view['name']}: {view['kind']}, {view['where']}"]
    since, ended = view.get("started"), view.get("ended")
    ran = "" if since is None else (f" after {duration(ended - since)}" if ended else
                                    f" for {duration(now - since)}")
    lines.append(f"  phase     {view['phase']}{ran}"
                 + (f": {view['message']}" if view.get("message") else ""))
    procs = view.get("procs")
    lines.append(f"  shape     {view['nodes']} node(s) x {procs} process(es)"
                 + ("" if str(procs).isdigit() else " per node"))
    progress = view.get("progress") or {}
    bar = progress_line(progress)
    if bar:
        lines.append(f"  progress  {bar}")
    metrics = progress.get("metrics") or {}
    if metrics:
        when = progress.get("updated")
        ago = "" if when is None else f"  ({duration(now - when)} ago)"
        lines.append("  metrics   " + " ".join(f"{n}={_number(v)}" for n, v in metrics.items())
                     + ago)
    if not bar and not metrics:
        lines.append("  progress  none printed yet: rank 0's `name=value` lines show here "
                     "(docs/scripts.md)")
    elif view.get("source"):
        lines.append(f"  (read from {view['source']})")
    return "\n".join(lines)


def list_text(views: list) -> str:
    """The table `kfvision job list` prints."""
    rows = [("NAME", "KIND", "WHERE", "PHASE", "NODES", "PROGRESS", "LEFT")]  # WHERE: namespace
    for v in views:
        p = v.get("progress") or {}
        pos = "" if p.get("position") is None else f"{p['position']} {_number(p.get('value'))}"
        shown = f"{p['percent']}%" if p.get("percent") is not None else pos or "-"
        where = "local" if v["where"].startswith("local") else v["where"].split()[-1]
        rows.append((v["name"], v["kind"], where, v["phase"], f"{v['nodes']}x{v['procs']}",
                     shown, duration(p["eta_s"]) if p.get("eta_s") else "-"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def _status(args) -> int:
    from kfvision.pipelines.jobs.backends import ENDED, pick

    backend = pick(args.name, args.namespace, args.log_dir)
    shown = 0
    while True:
        now = time.time()
        view = backend.status(args.name, now)
        text = json.dumps(view, indent=1) if args.json else status_text(view, now)
        if shown and sys.stdout.isatty():  # redraw in place: up over the last block, clear it
            sys.stdout.write(f"\x1b[{shown}F\x1b[J")
        print(text, flush=True)
        shown = text.count("\n") + 1
        if not args.watch or view["phase"] in ENDED:
            return 0
        time.sleep(args.poll)


def _list(args) -> int:
    from kfvision.pipelines.jobs.backends import pick

    now = time.time()
    views = pick(None, args.namespace, root=args.log_root or LOG_ROOT).list(now)
    if args.json:
        print(json.dumps(views, indent=1))
    elif views:
        print(list_text(views))
    else:
        print(f"no job kfvision rendered in namespace {args.namespace or '(the context)'}")
    return 0


def add_status(sub) -> None:
    """`kfvision job status NAME` and `kfvision job list`, with the cluster commands' -n
    (pipelines/cli/clusterargs.py)."""
    from kfvision.pipelines.cli.clusterargs import TARGET, add_command

    s = add_command(
        sub, "status", _status,
        "where a job stands: phase, nodes x processes, progress, metrics", name="job name",
        flags=(*TARGET, "poll"), allow_abbrev=False,  # --poll: for --watch
        description="Show a job's phase, its nodes x processes, its progress (bar, position, "
        "time left) and last metrics: from its local run's record (`job run-local`, `job run`), "
        "else from the cluster (a TrainJob's status.trainerStatus, a PyTorchJob's rank-0 log); "
        "with --watch again every --poll seconds until the job has ended.")
    s.add_argument("--log-dir", help="the local run's folder (default: build/jobs/NAME)")
    s.add_argument("--json", action="store_true", help="print it as JSON")
    s.add_argument("-w", "--watch", action="store_true", help="redraw it every --poll seconds "
                   "until the job has ended")
    ls = add_command(
        sub, "list", _list,
        "the jobs and where each stands (local runs, or the cluster's)", allow_abbrev=False,
        description="List the local runs under --log-root, or (with -n, or when there is "
        "none) the jobs kfvision rendered on the cluster, of both kinds, with phase, shape and "
        "progress.")
    ls.add_argument("--log-root", help="the folder of local runs (default: build/jobs)")
    ls.add_argument("--json", action="store_true", help="print them as JSON")
