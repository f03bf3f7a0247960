"""`kfvision job run-local job.yaml`: run a PyTorchJob on this machine as the operator would.

One process per replica (Master first, then Workers), each running the `pytorch` container's
command and args with the manifest's env plus exactly the environment the Training Operator v1.9.4
injects (../shared/reference/README.md), except that the Master's address is the loopback address
and its port a free one. The image is not pulled: the `torchrun`/`python` of the environment
kfvision runs in stand in for the image's (its bin folder goes first on PATH).

The job succeeds when the Master succeeds. A replica that fails is restarted or fails the job as
its `restartPolicy` says, with every restart counted against `runPolicy.backoffLimit`; a failure,
a passed `activeDeadlineSeconds`, Ctrl-C or SIGTERM stop every process the run started. `faults`
(pipelines/jobs/faults.py) kill a pod or a training process when a log line matches, to show that
the job survives it.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kfvision.pipelines.clients.endpoints import free_port
from kfvision.pipelines.jobs.errors import InvalidJobError, JobFailedError
from kfvision.pipelines.jobs.failed import failure
from kfvision.pipelines.jobs.faults import FaultInjector
from kfvision.pipelines.jobs.procs import (
    STOP,
    LocalResult,
    Printer,
    ReplicaProcess,
    container_argv,
    gpu_env,
    pod_env,
    proc_table,
    supervised,
)
from kfvision.pipelines.jobs.pytorchjob.rules import (
    CONTAINER_NAME,
    DEFAULT_PORT,
    PORT_NAME,
    validate_pytorchjob,
)
from kfvision.pipelines.jobs.sandbox import choose, pod_argv
from kfvision.pipelines.jobs.volumes import materialize

LOCAL_BACKOFF_LIMIT = 6  # when the manifest sets none: what a Kubernetes Job uses, so we end


@dataclass(frozen=True)
class ReplicaPlan:
    """One pod of the job: `master-0`, `worker-0`, ... and what it runs."""

    rtype: str
    index: int
    restart_policy: str
    container: dict

    @property
    def name(self) -> str:
        return f"{self.rtype.lower()}-{self.index}"

    @property
    def node_rank(self) -> int:
        return self.index if self.rtype == "Master" else self.index + 1


def _replica_count(spec: dict) -> int:
    return 1 if spec.get("replicas") is None else int(spec["replicas"])


def master_port(job: dict) -> int:
    """The port of the Master's `pytorchjob-port` (the operator's default when it has none)."""
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    for c in master:
        if c.get("name") == CONTAINER_NAME:
            for p in c.get("ports") or []:
                if p.get("name") == PORT_NAME:
                    return int(p["containerPort"])
    return DEFAULT_PORT


def operator_env(job: dict, plan: ReplicaPlan, master_addr: str | None = None,
                 port: int | None = None) -> dict:
    """The variables the operator injects into `plan`'s pod (non-elastic job with a Master).

    `master_addr`/`port` default to the cluster's values: `<job>-master-0` and the Master's
    `pytorchjob-port`. Values as in ../shared/reference/README.md.
    """
    specs = job["spec"]["pytorchReplicaSpecs"]
    nodes = sum(_replica_count(s) for s in specs.values())
    nproc = str(job["spec"].get("nprocPerNode") or "auto")
    per_node = int(nproc) if nproc.isdigit() else 1  # auto/cpu/gpu count as 1 (the operator's rule)
    addr = master_addr or f"{job['metadata']['name']}-master-0"
    port = str(port or master_port(job))
    return {"PYTHONUNBUFFERED": "1", "MASTER_ADDR": addr, "PET_MASTER_ADDR": addr,
            "MASTER_PORT": port, "PET_MASTER_PORT": port, "PET_NNODES": str(nodes),
            "PET_NPROC_PER_NODE": nproc, "WORLD_SIZE": str(nodes * per_node),
            "RANK": str(plan.node_rank), "PET_NODE_RANK": str(plan.node_rank)}


def plan_replicas(job: dict, source: str = "the manifest") -> list:
    """Master-0, then Worker-0..N-1, each with its `pytorch` container and restart policy."""
    validate_pytorchjob(job, source)
    spec = job["spec"]
    if spec.get("elasticPolicy") is not None:
        raise InvalidJobError(f"{source} has spec.elasticPolicy: run-local reproduces only "
                              "non-elastic jobs (fixed Master + Workers). Remove it.")
    specs = spec["pytorchReplicaSpecs"]
    if "Master" not in specs:
        raise InvalidJobError(f"{source} has no Master replica: run-local needs one (the "
                              "operator's rendezvous environment then points at master-0).")
    plans = []
    for rtype in ("Master", "Worker"):
        if rtype not in specs:
            continue
        rspec = specs[rtype]
        container = next(c for c in rspec["template"]["spec"]["containers"]
                         if c.get("name") == CONTAINER_NAME)
        if not container.get("command"):
            raise InvalidJobError(f"{source}: {rtype}'s container {CONTAINER_NAME!r} has no "
                                  "command; run-local cannot know the image's entrypoint. "
                                  "Write the command (e.g. [torchrun, -m, "
                                  "kfvision.trainer.train]).")
        for i in range(_replica_count(rspec)):
            # The operator's default restart policy (see the reference's "Defaults").
            plans.append(ReplicaPlan(rtype, i, rspec.get("restartPolicy") or "OnFailure",
                                     container))
    return plans


def should_restart(policy: str, code: int) -> bool:
    """Whether `policy` retries a replica that exited with `code` (non-zero)."""
    if policy in ("OnFailure", "Always"):
        return True
    if policy == "ExitCode":
        return 128 <= code <= 255  # 1-127 are permanent failures; signals (128+N) are retried
    return False  # Never


def replica_command(job: dict, plan: ReplicaPlan, plans: list, port: int,
                    source: str = "the manifest") -> tuple:
    """(argv, env) of one replica on this machine: host env less launcher variables, then the
    container's env, its GPUs, and the operator's variables (master = 127.0.0.1:`port`)."""
    env = pod_env(plan.container, source)
    env.update(gpu_env(plan, plans))
    env.update(operator_env(job, plan, master_addr="127.0.0.1", port=port))
    return container_argv(plan.container, env, source)


def _supervise(job: dict, plans: list, procs: list, restart_delay_s: float) -> tuple:
    """Wait until the Master succeeds (returns (restarts, exit codes)) or the job fails (raises).

    Mirrors the operator: a replica failure is retried per its restartPolicy while the job's
    restarts stay within backoffLimit, and anything else fails the whole job.
    """
    name = job["metadata"]["name"]
    run_policy = job["spec"].get("runPolicy") or {}
    limit = run_policy.get("backoffLimit")
    limit = LOCAL_BACKOFF_LIMIT if limit is None else limit
    deadline_s = run_policy.get("activeDeadlineSeconds")
    start, restarts, codes, last_scan = time.monotonic(), 0, {}, 0.0
    due = {}  # replica name -> (when it restarts, its note): each on its own clock, as kubelet
    while True:
        now = time.monotonic()
        if now - last_scan > 0.5:  # remember descendants before their parents can exit
            table = proc_table()
            for r in procs:
                r.remember_descendants(table)
            last_scan = now
        for plan, r in zip(plans, procs, strict=True):
            if r.name in due:
                if now >= due[r.name][0]:
                    r.start(note=due.pop(r.name)[1])
                continue
            if r.name in codes:
                continue
            code = r.poll()
            if code is None:
                continue
            if code == 0:
                codes[r.name] = 0
                if plan.rtype == "Master":
                    return restarts, codes
                continue
            if not should_restart(plan.restart_policy, code):
                raise failure(name, r, code, f"restartPolicy {plan.restart_policy} does not "
                               "retry it", procs)
            if restarts >= limit:
                raise failure(name, r, code, f"backoffLimit {limit} reached after {restarts} "
                               "restart(s)", procs)
            restarts += 1
            due[r.name] = (time.monotonic() + restart_delay_s,
                           f"--- restart {restarts} (exit code {code}, restartPolicy "
                           f"{plan.restart_policy}, backoffLimit {limit}) ---")
        if deadline_s is not None and time.monotonic() - start > deadline_s:
            raise JobFailedError(f"job {name} failed: DeadlineExceeded (it ran longer than "
                                 f"runPolicy.activeDeadlineSeconds = {deadline_s} s).")
        STOP.sleep(0.1)


def run_local(job: dict, log_dir, *, source: str = "the manifest", out=None, quiet: bool = False,
              grace_s: float = 30.0, restart_delay_s: float = 1.0, faults=(),
              config_maps: dict | None = None, on_line=None,
              sandbox: bool | None = None) -> LocalResult:
    """Run the PyTorchJob `job` (a dict) on this machine, the way the Training Operator would.

    Args:
        job: the manifest (e.g. yaml.safe_load of `kfvision job render`'s output).
        log_dir: per-replica logs go to LOG_DIR/master-0.log, worker-0.log, ...
        out: where prefixed log lines go (default sys.stdout); quiet: files only.
        grace_s: once the Master succeeded, how long Workers may take to finish by themselves.
        restart_delay_s: pause before restarting a failed replica (kubelet backs off 10 s+).
        faults: Fault(target, after, signal) to inject, each once (pipelines/jobs/faults.py).
        config_maps: {name: ConfigMap} of the same file, for the pods' ConfigMap volumes
            (pipelines/jobs/volumes.py).
        on_line: called with (replica name, line) for every line a replica prints.
        sandbox: run each pod inside its filesystem (pipelines/jobs/sandbox.py): None = where
            bwrap can, False = never.
    Returns:
        LocalResult (seconds, restarts, exit codes of the replicas that ended by themselves).
    Raises:
        InvalidJobError: the manifest breaks a webhook rule or cannot run here.
        JobFailedError: a replica failed past its restart policy, or the deadline passed.
        Interrupted: SIGINT or SIGTERM came (pipelines/jobs/signals.py); every process stopped.
    """
    plans = plan_replicas(job, source)
    port = free_port()
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    printer = FaultInjector(faults, Printer(out or sys.stdout, quiet, also=on_line))
    bwrap = choose(sandbox, say=lambda text: print(f"[run-local] {text}", file=sys.stderr))
    procs = []
    for plan in plans:
        argv, env = replica_command(job, plan, plans, port, source)
        pod = job["spec"]["pytorchReplicaSpecs"][plan.rtype]["template"]["spec"]
        mounts = plan.container.get("volumeMounts") or []  # the pod's ConfigMaps, emptyDirs
        env.update(materialize(pod.get("volumes") or [], mounts, config_maps or {},
                               log_dir / "pods" / plan.name, source, env))
        cwd = plan.container.get("workingDir")
        argv, memory = pod_argv(bwrap, argv, pod, plan.container, env, cwd=cwd, say=lambda text,
                                n=plan.name: print(f"[{n}] {text}", file=sys.stderr))
        path = log_dir / f"{plan.name}.log"
        path.write_text("")
        procs.append(ReplicaProcess(plan.name, argv, env, path, printer, cwd=cwd,
                                    memory=memory))
    printer.attach(procs)
    start = time.monotonic()
    with supervised(procs):
        for r in procs:  # Master first: it hosts the rendezvous store
            r.start()
            STOP.check()
        restarts, codes = _supervise(job, plans, procs, restart_delay_s)
        end = time.monotonic() + grace_s
        while time.monotonic() < end and any(r.name not in codes for r in procs):
            for r in procs:
                code = r.poll() if r.name not in codes else None
                if code is not None:
                    codes[r.name] = code
            STOP.sleep(0.1)
    return LocalResult(job["metadata"]["name"], time.monotonic() - start, restarts, log_dir,
                       codes, printer.fired)
