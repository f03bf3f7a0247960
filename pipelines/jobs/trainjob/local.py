"""`kfvision job run-local job.yaml` for a TrainJob: its nodes as local processes, as Kubeflow
Trainer v2.3.0 and its runtime would run them.

One process per node (`node-0-0`, `node-0-1`, ...: the JobSet's pod hostnames), each running
`trainer.command` + `trainer.args` with `trainer.env` plus exactly the `PET_*` variables the torch
plugin injects (../shared/reference/README.md), except that the master address is the loopback
address and the port a free one; with a status endpoint (Kubeflow Trainer's TrainJobStatus feature
gate), also the three variables of its `trainjobstatus` plugin, so that the trainer reports its
progress as on the cluster. The image stands in by this machine's programs, as for
PyTorchJobs (pipelines/jobs/pytorchjob/local.py).

What is retried follows the runtime the TrainJob references (kfvision-torch or the stock
torch-distributed; run-local knows these two): a node that exits with a code of the Job's
`podFailurePolicy` FailJob rule fails its Job (reason PodFailurePolicy); any other failure restarts
that node while the Job's `backoffLimit` lasts, then fails its Job (BackoffLimitExceeded); a
failed Job goes through the JobSet's `failurePolicy` rules (FailJobSet, or RestartJobSet: every
node again, counted against `maxRestarts`). The TrainJob completes when every node has succeeded.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kfvision.pipelines.clients.endpoints import free_port
from kfvision.pipelines.clients.k8s import quantity
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
    stop_all,
    supervised,
)
from kfvision.pipelines.jobs.sandbox import choose, pod_argv
from kfvision.pipelines.jobs.trainjob.build import KFVISION_RUNTIME, build_runtime
from kfvision.pipelines.jobs.trainjob.rules import (
    ANCESTOR_LABEL,
    ANCESTOR_TRAINER,
    API_VERSION,
    FRAMEWORK_LABEL,
    MASTER_PORT,
    NODE,
    PET_NAMES,
    STOCK_IMAGE,
    STOCK_RUNTIME,
    runtime_jobs,
    validate_trainjob,
)
from kfvision.pipelines.jobs.volumes import materialize, trainjob_pod
from kfvision.trainer.upstream import (
    TRAINER_CA_CERT_FILE,
    TRAINER_SERVER_CA_CERT,
    TRAINER_SERVER_TOKEN,
    TRAINER_SERVER_URL,
    TRAINER_STATUS_PATH,
    TRAINER_TOKEN_FILE,
)

# ../shared/reference/trainer-v2/torch_distributed.yaml, the runtime the platform installs
STOCK = {"apiVersion": API_VERSION, "kind": "ClusterTrainingRuntime",
         "metadata": {"name": STOCK_RUNTIME, "labels": {FRAMEWORK_LABEL: "torch"}},
         "spec": {"mlPolicy": {"numNodes": 1, "torch": {}}, "template": {"spec": {
             "replicatedJobs": [{"name": NODE, "template": {
                 "metadata": {"labels": {ANCESTOR_LABEL: ANCESTOR_TRAINER}},
                 "spec": {"template": {"spec": {"containers": [{
                     "name": NODE, "image": STOCK_IMAGE}]}}}}}]}}}}


def known_runtime(ref: dict, source: str = "the manifest") -> dict:
    """The runtime `ref` (a runtimeRef) names, for the runtimes run-local knows."""
    name = ref.get("name")
    if name == KFVISION_RUNTIME:
        return build_runtime("local", kind=ref.get("kind") or "ClusterTrainingRuntime")
    if name == STOCK_RUNTIME:
        return STOCK
    raise InvalidJobError(f"{source}: runtimeRef {name!r} is not a runtime run-local knows "
                          f"({KFVISION_RUNTIME}, {STOCK_RUNTIME}); render with --runtime "
                          f"{KFVISION_RUNTIME} to run it here with the same failure policy.")


@dataclass(frozen=True)
class FailurePolicy:
    """The runtime's retry rules, with the defaults Job and JobSet apply when it sets none."""

    pod_restart: str  # the node pods' restartPolicy (JobSet defaults it to OnFailure)
    backoff_limit: int  # the Job's (Kubernetes default 6)
    fail_codes: frozenset  # exit codes of container `node` that a FailJob rule matches
    max_restarts: int  # the JobSet's (default 0: a failed Job fails the JobSet)
    rules: tuple  # ((action, (reasons...)), ...) in order; no match means RestartJobSet

    @classmethod
    def of(cls, runtime: dict) -> "FailurePolicy":
        spec = runtime["spec"]["template"]["spec"]
        rjob = next(j for j in spec["replicatedJobs"] if j["name"] == NODE)["template"]["spec"]
        codes = set()
        for rule in (rjob.get("podFailurePolicy") or {}).get("rules") or []:
            on = rule.get("onExitCodes") or {}
            if rule.get("action") == "FailJob" and on.get("containerName", NODE) == NODE:
                values = set(on.get("values") or [])
                codes |= values if on.get("operator") == "In" else set(range(1, 256)) - values
        failure = spec.get("failurePolicy") or {}
        return cls(rjob["template"]["spec"].get("restartPolicy") or "OnFailure",
                   rjob.get("backoffLimit", 6), frozenset(codes), failure.get("maxRestarts", 0),
                   tuple((r["action"], tuple(r.get("onJobFailureReasons") or ()))
                         for r in failure.get("rules") or []))

    def action(self, reason: str) -> str:
        """The JobSet's action for a Job that failed with `reason`."""
        return next((a for a, reasons in self.rules if not reasons or reason in reasons),
                    "RestartJobSet")


@dataclass(frozen=True)
class NodePlan:
    index: int
    container: dict  # command, args, env, resources: what `trainer` gives container `node`

    @property
    def name(self) -> str:
        return f"{NODE}-0-{self.index}"


@dataclass(frozen=True)
class StatusEndpoint:
    """Where Kubeflow Trainer's status server answers, as its `trainjobstatus` plugin (feature
    gate TrainJobStatus) tells the trainer's pods: `base` (https://host:port) and `secrets_dir`,
    the folder of the projected volume's `ca.crt` and `token` (on a cluster
    /var/run/secrets/kubeflow/trainer; here any folder holding the two files)."""

    base: str
    secrets_dir: Path


def _node_resources(job: dict, runtime: dict) -> dict:
    """trainer.resourcesPerNode, else the runtime's `node` container's resources (torch.go:
    runtime.ExtractResourcePerNodeFromRuntime, overridden by the TrainJob's when it has any)."""
    given = (job["spec"].get("trainer") or {}).get("resourcesPerNode")
    if given:
        return given
    for rjob in ((runtime.get("spec") or {}).get("template") or {}).get("spec", {}).get(
            "replicatedJobs") or []:
        pod = rjob["template"]["spec"]["template"]["spec"]
        for c in pod.get("containers") or []:
            if rjob["name"] == NODE and c.get("name") == NODE:
                return c.get("resources") or {}
    return {}


def _gpus(resources: dict) -> int:
    """runtime.GetNumGPUPerNode: the first resource whose name contains "gpu" (any case) in the
    requests, else in the limits when that is 0."""
    def first(listed):
        return next((quantity(v) for k, v in (listed or {}).items() if "gpu" in k.lower()), 0)

    return first(resources.get("requests")) or first(resources.get("limits"))


def _cpus(resources: dict) -> int:
    """torch.go getNumCPUPerNode: requests.cpu unless absent or zero, else limits.cpu, else 0."""
    request = (resources.get("requests") or {}).get("cpu")
    if request is not None and quantity(request) != 0:
        return quantity(request)
    limit = (resources.get("limits") or {}).get("cpu")
    return quantity(limit) if limit is not None else 0


def torch_env(job: dict, index: int, master_addr: str | None = None,
              port: int | None = None, runtime: dict | None = None) -> dict:
    """The variables the torch plugin (v2.3.0 torch.go, EnforceMLPolicy) injects into node
    `index`'s container `node`; `runtime`: the one the job references (its node count and
    node resources are the defaults of the TrainJob's)."""
    trainer, name = job["spec"].get("trainer") or {}, job["metadata"]["name"]
    runtime = runtime or {}
    policy = (runtime.get("spec") or {}).get("mlPolicy") or {}
    nodes = trainer.get("numNodes", policy.get("numNodes", 1))
    resources = _node_resources(job, runtime)
    if trainer.get("numProcPerNode") is not None:
        nproc = str(trainer["numProcPerNode"])
    elif _gpus(resources):
        nproc = "auto"
    else:
        nproc = str(max(1, _cpus(resources)))
    return dict(zip(PET_NAMES, (str(nodes), nproc, str(index),
                                master_addr or f"{name}-{NODE}-0-0.{name}",
                                str(port or MASTER_PORT)), strict=True))


def status_env(job: dict, runtime: dict, status: StatusEndpoint | None) -> dict:
    """What the `trainjobstatus` plugin (v2.3.0 trainjobstatus.go) injects into the containers of
    the runtime's replicated job labelled as the trainer's ancestor: nothing when the gate is
    off (`status` None) or no replicated job carries the label."""
    if status is None:
        return {}
    labelled = [rjob for rjob in runtime["spec"]["template"]["spec"]["replicatedJobs"]
                if ((rjob["template"].get("metadata") or {}).get("labels") or {}).get(
                    ANCESTOR_LABEL) == ANCESTOR_TRAINER]
    if not any(rjob["name"] == NODE for rjob in labelled):
        return {}
    meta = job["metadata"]
    path = TRAINER_STATUS_PATH.format(namespace=meta.get("namespace") or "default",
                                      name=meta["name"])
    return {TRAINER_SERVER_URL: status.base.rstrip("/") + path,
            TRAINER_SERVER_CA_CERT: str(Path(status.secrets_dir) / TRAINER_CA_CERT_FILE),
            TRAINER_SERVER_TOKEN: str(Path(status.secrets_dir) / TRAINER_TOKEN_FILE)}


def plan_nodes(job: dict, source: str = "the manifest") -> tuple:
    """([NodePlan...], FailurePolicy, runtime) of a TrainJob, checked against its runtime."""
    runtime = known_runtime((job.get("spec") or {}).get("runtimeRef") or {}, source)
    validate_trainjob(job, source, runtime_jobs(runtime))
    trainer = job["spec"].get("trainer") or {}
    if not trainer.get("command"):
        raise InvalidJobError(f"{source}: spec.trainer has no command; run-local cannot know "
                              "the image's entrypoint. Write it (e.g. [torchrun, -m, ...]).")
    container = {"command": trainer["command"], "args": trainer.get("args") or [],
                 "env": trainer.get("env") or [],
                 "resources": {"limits": (trainer.get("resourcesPerNode") or {}).get("limits")
                               or {}}}
    count = int(torch_env(job, 0, runtime=runtime)[PET_NAMES[0]])
    return [NodePlan(i, container) for i in range(count)], FailurePolicy.of(runtime), runtime


def _node_command(job: dict, plan: NodePlan, plans: list, port: int, source: str,
                  runtime: dict, status: StatusEndpoint | None) -> tuple:
    """(argv, env) of one node: the pod's environment here (trainer.env), its GPUs, the torch
    plugin's variables (master = 127.0.0.1:`port`) and, with `status`, the trainjobstatus
    plugin's."""
    env = pod_env(plan.container, source)
    env.update(gpu_env(plan, plans))
    env.update(torch_env(job, plan.index, master_addr="127.0.0.1", port=port, runtime=runtime))
    env.update(status_env(job, runtime, status))
    return container_argv(plan.container, env, source)


class _Supervisor:
    """Applies the runtime's FailurePolicy to the node processes until they all succeed."""

    def __init__(self, job: dict, procs: list, policy: FailurePolicy, restart_delay_s: float):
        self.name, self.procs, self.policy = job["metadata"]["name"], procs, policy
        self.deadline_s = job["spec"].get("activeDeadlineSeconds")
        self.delay, self.restarts, self.jobset_restarts = restart_delay_s, 0, 0
        self.due = {}  # pod name -> (when it restarts, its note): each on its own clock

    def _restart(self, procs: list, note: str) -> None:
        """Restart `procs` after the delay: one pod on its own clock, as kubelet restarts a
        container while its peers go on; the whole JobSet at once, after a pause."""
        self.restarts += 1
        note = f"--- restart {self.restarts} ({note}) ---"
        if len(procs) == 1:
            self.due[procs[0].name] = (time.monotonic() + self.delay, note)
            return
        self.due.clear()
        STOP.sleep(self.delay)
        for r in procs:
            r.start(note=note)

    def _job_failed(self, r, code: int, reason: str, codes: dict) -> None:
        action = self.policy.action(reason)
        counted = not action.endswith("IgnoreMaxRestarts")
        if action == "FailJobSet" or (counted and self.jobset_restarts >= self.policy.max_restarts):
            why = (f"Job failed ({reason}); the runtime's JobSet failurePolicy "
                   + ("fails the TrainJob" if action == "FailJobSet" else
                      f"maxRestarts {self.policy.max_restarts} reached"))
            raise failure(self.name, r, code, why, self.procs)
        self.jobset_restarts += counted
        stop_all(self.procs)
        codes.clear()
        self._restart(self.procs, f"exit code {code}: Job failed ({reason}), JobSet {action} "
                      f"{self.jobset_restarts}/{self.policy.max_restarts}")

    def run(self) -> dict:
        start, codes, job_retries, last_scan = time.monotonic(), {}, 0, 0.0
        while len(codes) < len(self.procs) or any(c != 0 for c in codes.values()):
            if time.monotonic() - last_scan > 0.5:
                table = proc_table()
                for r in self.procs:
                    r.remember_descendants(table)
                last_scan = time.monotonic()
            for r in self.procs:
                if r.name in self.due:
                    if time.monotonic() >= self.due[r.name][0]:
                        r.start(note=self.due.pop(r.name)[1])
                    continue
                code = None if codes.get(r.name) == 0 else r.poll()
                if code is None or code == 0:
                    if code == 0:
                        codes[r.name] = 0
                    continue
                if code in self.policy.fail_codes:
                    self._job_failed(r, code, "PodFailurePolicy", codes)
                    job_retries = 0
                elif job_retries < self.policy.backoff_limit:
                    job_retries += 1
                    self._restart([r], f"exit code {code}, pod restartPolicy "
                                  f"{self.policy.pod_restart}, Job backoffLimit "
                                  f"{self.policy.backoff_limit}")
                else:
                    self._job_failed(r, code, "BackoffLimitExceeded", codes)
                    job_retries = 0
                break
            if self.deadline_s is not None and time.monotonic() - start > self.deadline_s:
                raise JobFailedError(f"TrainJob {self.name} failed: DeadlineExceeded (it ran "
                                     f"longer than spec.activeDeadlineSeconds = "
                                     f"{self.deadline_s} s).")
            STOP.sleep(0.1)
        return codes


def run_local(job: dict, log_dir, *, source: str = "the manifest", out=None,
              quiet: bool = False, restart_delay_s: float = 1.0, faults=(),
              status: StatusEndpoint | None = None,
              config_maps: dict | None = None, on_line=None,
              sandbox: bool | None = None) -> LocalResult:
    """Run the TrainJob `job` (a dict) on this machine, as Kubeflow Trainer and its runtime would.

    Args and result as kfvision.pipelines.jobs.pytorchjob.local.run_local (logs in
    LOG_DIR/node-0-<i>.log); `status`: the status server the nodes report progress to, as with
    Kubeflow Trainer's TrainJobStatus feature gate on (None: the gate off, nothing is injected);
    `config_maps`: {name: ConfigMap} of the same file, for the pods' ConfigMap volumes
    (pipelines/jobs/volumes.py); `on_line`: called with (node name, line) for every line;
    `sandbox`: as for a PyTorchJob (pipelines/jobs/sandbox.py).
    Raises:
        InvalidJobError: the manifest breaks a rule, names an unknown runtime, or cannot run here.
        JobFailedError: the runtime's failure policy failed the job, or the deadline passed.
        Interrupted: SIGINT or SIGTERM came (pipelines/jobs/signals.py); every process stopped.
    """
    plans, policy, runtime = plan_nodes(job, source)
    port = free_port()
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    printer = FaultInjector(faults, Printer(out or sys.stdout, quiet, also=on_line))
    bwrap = choose(sandbox, say=lambda text: print(f"[run-local] {text}", file=sys.stderr))
    security = {}
    volumes, mounts = trainjob_pod(job, security)
    procs = []
    for plan in plans:
        argv, env = _node_command(job, plan, plans, port, source, runtime, status)
        env.update(materialize(volumes, mounts, config_maps or {},  # ConfigMaps, emptyDirs
                               log_dir / "pods" / plan.name, source, env))
        pod = {"volumes": volumes, "securityContext": security.get("pod")}
        container = {**plan.container, "volumeMounts": mounts,
                     "securityContext": security.get("container")}
        argv, memory = pod_argv(bwrap, argv, pod, container, env, say=lambda text, n=plan.name:
                                print(f"[{n}] {text}", file=sys.stderr))
        (log_dir / f"{plan.name}.log").write_text("")
        procs.append(ReplicaProcess(plan.name, argv, env, log_dir / f"{plan.name}.log", printer,
                                    memory=memory))
    printer.attach(procs)
    start = time.monotonic()
    supervisor = _Supervisor(job, procs, policy, restart_delay_s)
    with supervised(procs):
        for r in procs:
            r.start()
            STOP.check()
        codes = supervisor.run()
    return LocalResult(job["metadata"]["name"], time.monotonic() - start, supervisor.restarts,
                       log_dir, codes, printer.fired)
