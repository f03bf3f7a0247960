"""The container command of a user's-script job: unpack the source, install its requirements,
lay out the contract's folders, then run the script unchanged.

    python -I -u -m kfvision.pipelines.script.boot --sha256 SHA \\
        --snapshot /kfvision/source/source.tar.gz --entry train.py \\
        [--launcher torchrun|python] [--requirements requirements.txt] \\
        [--input NAME=URI ...] [--output-uri URI] -- SCRIPT ARGS

`kfvision job render --source` writes this command (pipelines/script/manifest.py); nobody needs to
type it. Steps, once per pod:
1. read the snapshot (a file of the ConfigMap volume or of a PVC, or an `s3://` object), check
   its sha256, unpack it into WORK/src, the script's working folder;
2. install the requirements into a cached environment that keeps the image's torch
   (pipelines/script/env.py);
3. fetch `s3://` input channels once into WORK/input/NAME (a path is passed as it is);
4. run the script with the contract's variables (pipelines/contract.py) and OMP_NUM_THREADS (the
   pod's usable cores shared by its processes, unless given): through `python -I -u -m
   kfvision.trainer.launch` (torchrun that keeps exit codes, on this interpreter, isolated, which
   starts the processes on the environment's python) by default, or one `python` per pod with
   the Training Operator's classic variables (`--launcher python`; on a TrainJob they are made
   from the torch plugin's `PET_*`);
5. after success, node 0 writes contract.PROVENANCE into the model folder and copies the model
   and outputs folders to `--output-uri`.

With MLFLOW_TRACKING_URI in the pod, node 0 opens the script's MLflow run before step 4 and
closes it after (pipelines/script/track.py says why here and not at render). Meanwhile node 0
reads the `name=value` lines rank 0 prints into the run's metrics and the TrainJob's
status.trainerStatus (pipelines/script/reporter.py).

Every line of the pod's log starts with `[node/rank] ` (pipelines/jobs/ranktag.py): torchrun tees
each rank's output with that prefix, and the boot relays the rest (its own lines, pip's,
torchrun's) as `[node/-] `, so `kubectl logs`, `kfvision job logs --all` and `job run-local` tell
the ranks apart.

The exit code is the script's own (a signal N: 128 + N), so the job's restart policy retries
128-255 and fails 1-127 at once, as for the built-in trainer; the boot's own errors (a changed
snapshot, a requirement pip cannot install) exit 2. A failure ends with one line saying which
rank on which node failed first, with what code, after how long (pipelines/script/exits.py).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kfvision.pipelines import contract
from kfvision.pipelines.jobs import ranktag
from kfvision.pipelines.jobs.trainjob.rules import PET_NAMES
from kfvision.pipelines.script import bridges, collect, prepare, ranks, track
from kfvision.pipelines.script.exits import Exits
from kfvision.pipelines.script.redraws import Redraws, last_state
from kfvision.pipelines.script.reporter import Reporter
from kfvision.pipelines.script.snapshot import ARCHIVE_NAME, InvalidSourceError, unpack, verify
from kfvision.trainer import cpus, exitcodes
from kfvision.trainer.errors import KfvisionError
from kfvision.trainer.tracking import JOB_NAME

PREFIX = "[kfvision script]"
# How kfvision's own processes in the pod start (the boot: pipelines/script/manifest.py; the
# launcher: `command`): -I (isolated; Python 3.4+) keeps the script's folder, the working folder,
# PYTHONPATH and the user's site folder off their sys.path, so they import kfvision from the
# interpreter's install whatever the user's files are named. -I also ignores PYTHONUNBUFFERED,
# which the operator sets in every container: -u keeps the log lines flowing as they come.
ISOLATED = ("-I", "-u", "-m")
LAUNCHERS = ("torchrun", "python")
DEFAULT_WORK = "/kfvision/work"  # an emptyDir of the pod (pipelines/script/manifest.py)
# What the Training Operator v1.9.4 gives every pod (pkg/controller.v1/pytorch/envvar.go), made
# here from the torch plugin's PET_* on a TrainJob (pipelines/jobs/trainjob/rules.py has them)
_NNODES, NPROC, NODE_RANK, _ADDR, _PORT = PET_NAMES
THREADS = "OMP_NUM_THREADS"  # torch's intra-op threads follow it; a value given in the pod wins
CLASSIC = {"MASTER_ADDR": _ADDR, "MASTER_PORT": _PORT, "RANK": NODE_RANK, "WORLD_SIZE": _NNODES}


def node_of(environ) -> str:
    """This pod's node index: the torch plugin's (TrainJob, torchrun) or the operator's RANK."""
    return environ.get(NODE_RANK) or environ.get("RANK") or "0"


def say(text: str) -> None:
    # one write, line break included (print makes two): the relay thread writes the launcher's
    # lines into the same pipe, and would glue one onto a line cut before its break
    sys.stderr.write(f"{ranktag.tag(node_of(os.environ))}{PREFIX} {text}\n")
    sys.stderr.flush()


def read_snapshot(where: str, sha256: str) -> bytes:
    """The archive's bytes from a file (ConfigMap or PVC) or an s3:// object, hash-checked."""
    if where.startswith("s3://"):
        import tempfile

        from kfvision.pipelines.clients import s3, s3download

        bucket, key = s3.split_uri(where)
        obj = s3.head(where)
        if obj is None:
            raise InvalidSourceError(f"the source snapshot {where} is not there; render the "
                                     "job again (it uploads the snapshot).")
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / ARCHIVE_NAME
            s3download.download(obj, bucket, target)
            data = target.read_bytes()
    else:
        path = contract.pod_path(where)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise InvalidSourceError(f"cannot read the source snapshot {where}: {e}") from e
    verify(data, sha256, where)
    return data


def parse_input(text: str) -> tuple:
    name, sep, uri = text.partition("=")
    if not sep or not name or not uri:
        raise argparse.ArgumentTypeError(f"--input {text!r} is not NAME=URI")
    return name, uri


def fetch_inputs(inputs: list, work: Path) -> dict:
    """{name: folder} of the channels: s3:// fetched once into WORK/input/NAME, paths as given."""
    out = {}
    for name, uri in inputs:
        if uri.startswith("s3://"):
            from kfvision.pipelines.clients import s3sync

            fetched = s3sync.fetch(uri, work / "input" / name, progress=False)
            say(f"input {name}: {fetched.summary()}")
            path = fetched.path if fetched.path.is_dir() else fetched.path.parent
            out[name] = str(path)
        else:
            out[name] = uri
    return out


def save_outputs(uri: str, folders: dict) -> None:
    """Copy each {name: folder} to URI/name (s3:// or a path); says so when all are empty."""
    if not any(any(Path(folder).iterdir()) for folder in folders.values()):
        say(f"nothing to copy to {uri}: the script wrote nothing to the model folder "
            f"({contract.MODEL_DIR}) or ./outputs; the folders it wrote elsewhere stay in the pod "
            "(named above)")
        return
    for name, folder in folders.items():
        if not any(Path(folder).iterdir()):
            continue
        target = f"{uri.rstrip('/')}/{name}"
        if uri.startswith("s3://"):
            from kfvision.pipelines.clients import s3sync

            keys = s3sync.push(folder, target + "/", overwrite=True)
            say(f"{name}: {len(keys)} file(s) to {target}/")
        else:
            shutil.copytree(folder, target, dirs_exist_ok=True)
            say(f"{name}: copied to {target}")


def processes_per_pod(args, environ) -> int:
    """How many processes the launcher starts in this pod: torchrun's --nproc-per-node, which it
    reads from PET_NPROC_PER_NODE (default 1); `gpu` and `auto` are the pod's GPUs, `cpu` and
    `auto` without a GPU its CPUs (torch.distributed.run.determine_local_world_size)."""
    if args.launcher == "python":
        return 1
    given = environ.get(NPROC, "1")
    if given.isdigit():
        return max(1, int(given))
    if given in ("gpu", "auto") and args.gpus:
        return args.gpus
    return os.cpu_count() or 1


def script_env(args, python: Path, dirs: dict, inputs: dict) -> dict:
    env = dict(os.environ)
    env.pop(contract.POD_ROOT, None)
    node = int(node_of(env))
    hosts = args.hosts.split(",") if args.hosts else [f"node-{node}"]
    env.update(contract.contract_env(
        model=dirs["model"], outputs=dirs["outputs"], checkpoints=dirs["checkpoints"],
        tensorboard=dirs["tensorboard"], inputs=inputs, gpus=args.gpus, hosts=hosts,
        current_host=hosts[node] if node < len(hosts) else hosts[-1], sha256=args.sha256))
    if args.launcher == "python":
        for classic, pet in CLASSIC.items():
            if classic not in env and pet in env:
                env[classic] = env[pet]
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    # As the built-in trainer's threads (kfvision.trainer.distributed.cpus_per_process); torchrun
    # would set 1 for every process of a pod with several, and print a banner saying so
    env.setdefault(THREADS, str(cpus.per_process(processes_per_pod(args, env))))
    return env


def command(args, python: Path, node: str, work: Path, src: Path | None = None) -> list:
    """The launcher's argv. torchrun tees every rank's output with its `[node/rank] ` prefix
    (and keeps a file per rank under WORK/logs); `src`: the entry as a path under it (the
    script runs elsewhere: --workdir).

    kfvision's launcher runs on this interpreter, isolated (ISOLATED: neither the script's
    folder, the working folder nor PYTHONPATH is on its sys.path), and starts each process on
    `python` (the requirements' environment, or this interpreter) as torchrun would, `-u` and
    all: `--no-python` takes it as the program to run (docs/scripts.md, "Whose modules a job
    imports")."""
    entry = str(src / args.entry) if src is not None and args.entry else args.entry
    target = ["-m", args.module] if args.module else [entry]
    if args.call:  # a console script: what pip's generated wrapper does, argv[0] its name
        target = ["-c", f"import sys; sys.argv[0] = {args.console_script or args.call!r}; "
                  f"from {args.module} import {args.call.split('.')[0]}; "
                  f"sys.exit({args.call}())"]
    if args.launcher == "torchrun":
        tee = ["--tee", "3", "--log-line-prefix-template", ranktag.torchrun_template(node),
               "--log-dir", str(work / "logs")]
        return [sys.executable, *ISOLATED, "kfvision.trainer.launch", *tee, "--no-python",
                str(python), "-u", *target, *args.script_args]
    return [str(python), *target, *args.script_args]


def _job_processes(args, env: dict) -> int:
    """How many processes the whole job runs: the pods times each pod's."""
    if args.launcher == "python":
        return int(env.get("WORLD_SIZE") or env.get(_NNODES) or 1)
    return int(env.get(_NNODES) or 1) * processes_per_pod(args, env)


def say_setup(args, python: Path, env: dict) -> None:
    """Which kfvision and which python run, and each process's threads: what to look at when a
    job imports the wrong module or runs slow."""
    isolated = "isolated" if sys.flags.isolated else "not isolated: started without -I"
    say(f"kfvision's modules from {Path(contract.__file__).parent} on {sys.executable} "
        f"({isolated}); the script's python: {python}")
    procs = processes_per_pod(args, env)
    why = "as given" if THREADS in os.environ else f"{cpus.usable_cpus()} usable core(s) / {procs}"
    say(f"{procs} process(es), {THREADS}={env[THREADS]} each ({why})")


def relay(stream, node: str, rank: str, out, seen=None, on_line=None) -> None:
    """Copy the launcher's output to `out` line by line, each line prefixed with its
    `[node/rank] ` unless it carries one (torchrun's tee'd lines do); `seen` is called with each
    line as it came (the failure records: pipelines/script/exits.py), `on_line` with it tagged
    (node 0's progress: pipelines/script/reporter.py). A progress bar's redraws are written as
    their last state, at most every few seconds (pipelines/script/redraws.py)."""
    bars = Redraws()

    def write(lines: list) -> None:
        if lines:
            out.write("".join(f"{kept}\n" for kept in lines).encode("utf-8"))
            out.flush()

    for raw in iter(stream.readline, b""):
        for line in ranktag.split_glued(raw.decode("utf-8", errors="replace").rstrip("\n")):
            if seen is not None:
                seen(line)
            write(bars.feed(ranktag.tagged(last_state(line), node, rank)))
            if on_line is not None:
                on_line(ranktag.tagged(line, node, rank))
    write(bars.flush())
    stream.close()


def run(argv: list, cwd: Path, env: dict, rank: str = ranktag.POD, exits=None,
        on_line=None) -> int:
    """Run the launcher, passing SIGTERM/SIGINT on (a deleted pod), its output relayed with the
    `[node/rank] ` prefix (`rank`: of every line that has none) and handed to `on_line`; its exit
    status (128 + N for a signal N). `exits` (pipelines/script/exits.py) sees every line, the
    signals and the end."""
    exits = exits or Exits()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    pump = threading.Thread(target=relay, args=(proc.stdout, node_of(env), rank,
                                                sys.stdout.buffer, exits, on_line), daemon=True)
    pump.start()

    def forward(signum, frame):
        exits.signalled()
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
        exits.ended(proc.pid)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    pump.join(timeout=5.0)  # a process the script left behind may still hold the pipe
    return 128 - code if code < 0 else code


def boot(args) -> int:
    start = time.monotonic()
    work = contract.pod_path(args.work)
    src = work / "src"
    if src.exists():
        shutil.rmtree(src)  # a restarted container starts from the snapshot again
    (work / contract.SUCCEEDED).unlink(missing_ok=True)
    files = unpack(read_snapshot(args.snapshot, args.sha256), src)
    target = f"{args.module}:{args.call}" if args.call else (args.module or args.entry)
    say(f"source {args.sha256[:12]}: {len(files)} file(s) into {src}")
    if args.entry and not (src / args.entry).is_file():
        raise InvalidSourceError(f"--entry {args.entry} is not in the source snapshot.")
    cwd = src / args.workdir if args.workdir else src
    if not cwd.is_dir():
        raise InvalidSourceError(f"--workdir {args.workdir} is not a folder of the source "
                                 "snapshot.")
    python = prepare.install(prepare.requirements_file(args, src, files), src, work, say)
    state = contract.pod_path(args.state) if args.state else work / "state"
    dirs = {"model": work / contract.RESULTS["model"],
            "outputs": cwd / "outputs",  # the script's ./outputs, where it runs (--workdir)
            "checkpoints": state / "checkpoints", "tensorboard": state / "tensorboard"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    before = collect.entries(cwd)  # the script's own folders are what is new after it
    inputs = fetch_inputs(args.input, work)
    node = node_of(os.environ)
    tracker = None if node != "0" else track.open_run(
        os.environ, sha256=args.sha256, target=target, args=args.script_args,
        launcher=args.launcher, state=state, say=say)
    reporter = None if node != "0" else Reporter.from_env(os.environ, tracker, say)
    env = script_env(args, python, {k: str(v) for k, v in dirs.items()}, inputs)
    prepare.script_path(args, env, files, src, cwd, say)
    prepare.cpu_accelerate(args, env, python, say)
    track.script_env(tracker, env, dirs["outputs"])
    add, lines = bridges.plan(src, python, env)  # Azure's Run, horovod.torch: when theirs lacks
    for line in lines:
        say(line)
    bridges.apply(env, add)
    env = ranks.rank_env(env, work / "groups")
    argv = command(args, python, node, work, src if cwd != src else None)
    say_setup(args, python, env)
    say(f"ready in {time.monotonic() - start:.1f} s; running {target} ({args.launcher})")
    began, exits = time.time(), Exits()
    rank = env.get("RANK", node) if args.launcher == "python" else ranktag.POD
    code = run(argv, cwd, env, rank, exits, reporter and reporter.line)
    took = time.time() - began
    if reporter is not None:
        reporter.close()
    if code != 0:  # which rank failed first: the launcher's records, or the one process's
        for line in exits.failure_lines(code, node, began,
                                        rank if args.launcher == "python" else None):
            say(line)
        track.close_run(tracker, False, {})
        return code
    say(f"node {node}: {target} succeeded in {took:.1f} s")
    alone = ranks.alone_line(work / "groups", _job_processes(args, env))
    if node == "0" and alone:
        say(alone)
    if node == "0":
        kept = collect.collect(cwd, args.collect, dirs["outputs"], say)
        left = collect.made(cwd, before, dirs["outputs"], kept)
        collect.say_left(left, say)
        results = {"model": dirs["model"], "outputs": dirs["outputs"]}
        write_provenance(dirs["model"], args, tracker)
        track.close_run(tracker, True, results)
        if args.output_uri:
            save_outputs(args.output_uri, results)
        # the marker says where the results are (./outputs moves with --workdir)
        (work / contract.SUCCEEDED).write_text(json.dumps(
            {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             **{n: os.path.relpath(f, work) for n, f in results.items()},
             "left": {name: [files, size] for name, files, size in left}}) + "\n")
    return 0


def write_provenance(model_dir: Path, args, tracker) -> None:
    """contract.PROVENANCE in the model folder: the snapshot, entry and arguments it came from,
    and its MLflow run (`kfvision register` records them with the version)."""
    import json

    if not any(model_dir.iterdir()):  # the script saved no model there
        return
    record = {"source_sha256": args.sha256, "entry": f"{args.module}:{args.call}" if args.call
              else args.module or args.entry,
              "args": list(args.script_args), "job": os.environ.get(JOB_NAME)}
    if tracker is not None and not tracker.off:
        record.update(mlflow_run_id=tracker.run_id, mlflow_tracking_uri=tracker.uri)
    (model_dir / contract.PROVENANCE).write_text(json.dumps(record, indent=1) + "\n",
                                                  encoding="utf-8")


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kfvision.pipelines.script.boot", allow_abbrev=False,
                                description="Run a user's script in a kfvision job's pod.")
    p.add_argument("--sha256", required=True, help="the snapshot's sha256")
    p.add_argument("--snapshot", required=True, help="the snapshot: a file path or s3:// URI")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--entry", help="the script, relative to the source folder")
    where.add_argument("-m", "--module", help="the module to run (python -m)")
    p.add_argument("--call", help="with --module: the function to call (a console script)")
    p.add_argument("--console-script", help="with --call: its name (the script's argv[0])")
    p.add_argument("--requirements", help="requirements file, relative to the source folder")
    p.add_argument("--workdir", help="the folder the script runs in, relative to the source "
                   "folder (default: the source folder)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="torchrun", help="how to start it")
    p.add_argument("--work", default=DEFAULT_WORK, help="the pod's scratch folder")
    p.add_argument("--state", help="folder that outlives the pod (checkpoints, TensorBoard)")
    p.add_argument("--input", type=parse_input, action="append", default=[],
                   metavar="NAME=URI", help="data channel (repeatable)")
    p.add_argument("--collect", type=collect.check_collect, action="append", default=[],
                   metavar="DIR", help="a folder the script writes, kept under ./outputs")
    p.add_argument("--output-uri", help="where node 0 copies model/ and outputs/ after success")
    p.add_argument("--hosts", help="the pods' host names, node 0 first (SM_HOSTS)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs per pod (SM_NUM_GPUS)")
    p.add_argument("script_args", nargs="*", help="the script's arguments, after --")
    return p


def main(argv=None) -> int:
    args = get_parser().parse_args(argv)
    try:
        return boot(args)
    except KfvisionError as e:
        say(exitcodes.error_line(e))
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
