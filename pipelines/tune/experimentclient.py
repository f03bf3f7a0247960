"""Run a Katib Experiment on a cluster: submit (or re-attach), wait, status, delete; the best
trial's parameters and objective come from `status.currentOptimalTrial`. Every call goes through
pipelines/clients/k8s.py (one mapping of failures for jobs, Experiments and InferenceServices), and
manifests/rbac.yaml grants exactly these verbs:
    experiments: create, get, delete    trials: list, get (the best trial's model folder)
`ExperimentClient` speaks the verbs every cluster client does (pipelines/clients/cluster.py); a
timeout leaves the Experiment running.
"""

from kfvision.pipelines.clients.cluster import POLL_S, ClusterClient
from kfvision.pipelines.clients.k8s import Resource, WaitTimeoutError
from kfvision.pipelines.clients.k8s import connect as connect_api
from kfvision.pipelines.jobs.errors import JobFailedError
from kfvision.pipelines.script.manifest import OUTPUT_ANNOTATION, SHA_ANNOTATION
from kfvision.pipelines.tune.experiment import TRIAL_KINDS
from kfvision.pipelines.tune.katib_rules import EXPERIMENT_LABEL, GROUP, KIND, VERSION
from kfvision.pipelines.tune.katib_rules import TRIAL_KIND as TRIAL

KATIB_INSTALL = ("install Katib v0.19 (kubectl apply -k \"github.com/kubeflow/katib.git/manifests/"
                 "v1beta1/installs/katib-standalone?ref=v0.19.0\")")
EXPERIMENT = Resource(kind=KIND, group=GROUP, version=VERSION, plural="experiments",
                      install=KATIB_INSTALL)
TRIALS = Resource(kind=TRIAL, group=GROUP, version=VERSION, plural="trials", install=KATIB_INSTALL)
COUNTS = ("trialsSucceeded", "trialsRunning", "trialsPending", "trialsFailed",
          "trialsEarlyStopped", "trialsKilled")


def experiment_state(experiment: dict) -> tuple:
    """(state, message) of an Experiment: Succeeded or Failed once finished, else the latest
    true condition (Created, Running, Restarting) or Pending."""
    conditions = [c for c in (experiment.get("status") or {}).get("conditions") or []
                  if c.get("status") == "True"]
    for final in ("Succeeded", "Failed"):
        for c in conditions:
            if c.get("type") == final:
                return final, c.get("message") or c.get("reason") or ""
    return (conditions[-1]["type"], conditions[-1].get("message", "")) if conditions else (
        "Pending", "")


def progress(experiment: dict) -> str:
    """`2 succeeded, 1 running of 8 trials` from the Experiment's status counts."""
    status = experiment.get("status") or {}
    parts = [f"{status[c]} {c[len('trials'):].lower()}" for c in COUNTS if status.get(c)]
    total = experiment.get("spec", {}).get("maxTrialCount", "?")
    return f"{', '.join(parts) or 'no trials yet'} of {total} trials"


def best_trial(experiment: dict) -> tuple | None:
    """(trial name, {parameter: value}, objective name, objective value) of the best trial so
    far, or None before one reported its metrics. The value follows the objective's metric
    strategy (Katib's default: min when minimizing, max when maximizing)."""
    optimal = (experiment.get("status") or {}).get("currentOptimalTrial") or {}
    metrics = (optimal.get("observation") or {}).get("metrics") or []
    if not optimal.get("bestTrialName") or not metrics:
        return None
    objective = experiment["spec"]["objective"]
    name = objective["objectiveMetricName"]
    strategies = {s["name"]: s["value"] for s in objective.get("metricStrategies") or []}
    strategy = strategies.get(name, "min" if objective.get("type") == "minimize" else "max")
    value = next((m.get(strategy, m.get("latest")) for m in metrics if m["name"] == name), None)
    params = {p["name"]: p["value"] for p in optimal.get("parameterAssignments") or []}
    return optimal["bestTrialName"], params, name, value


class ExperimentClient(ClusterClient):
    """Katib Experiments (and their trials) in one namespace, through `api` (clients.k8s.Api)."""

    what, command = KIND, "tune"

    def create(self, experiment: dict) -> tuple:
        """Create `experiment`; if it already exists, return that one. -> (object, created)."""
        return self.api.create(EXPERIMENT, experiment)

    def submit(self, experiment: dict) -> dict:
        """Create the Experiment, or re-attach to the one of its name, saying which."""
        current, created = self.create(experiment)
        self.say(f"{'created' if created else 're-attached to existing'} "
                 f"{self.where(experiment['metadata']['name'])}")
        return current

    def get(self, name: str) -> dict:
        return self.api.get(EXPERIMENT, name)

    def delete(self, name: str) -> None:
        """Delete the Experiment; Katib's owner references take its trials and their jobs."""
        self.api.delete(EXPERIMENT, name)

    def trials(self, name: str) -> list:
        return self.api.list(TRIALS, f"{EXPERIMENT_LABEL}={name}")

    def trial_out(self, trial_name: str) -> str | None:
        """The best trial's model folder: the `--out` of its job (Katib's runSpec), or for a
        user's script the model folder under its --output-uri (None without one)."""
        trial = self.api.get(TRIALS, trial_name)
        job = (trial.get("spec") or {}).get("runSpec") or {}
        annotations = (job.get("metadata") or {}).get("annotations") or {}
        if SHA_ANNOTATION in annotations:  # a script's job: its arguments are its own
            uri = annotations.get(OUTPUT_ANNOTATION)
            return f"{uri.rstrip('/')}/model" if uri else None
        kind = TRIAL_KINDS.get(str(job.get("kind", "")).lower())
        for args in kind.trainer_args(job) if kind else []:
            if "--out" in args:
                return args[args.index("--out") + 1]
        return None

    def report(self, name: str, experiment: dict) -> None:
        """Print the state, the trial counts and the best trial (with its model folder)."""
        state, message = experiment_state(experiment)
        self.say(f"Experiment {self.namespace}/{name}: {state}; {progress(experiment)}"
                 + (f" ({message})" if message else ""))
        best = best_trial(experiment)
        if best is None:
            self.say("best trial: none yet (no trial has reported its metrics)")
            return
        trial, params, objective, value = best
        flags = " ".join(f"--{k} {v}" for k, v in params.items())
        self.say(f"best trial {trial}: {objective} {value} with {flags}")
        out = self.trial_out(trial)
        if out:
            self.say(f"its model: {out}")

    def trial_table(self, name: str) -> None:
        for t in self.trials(name):
            state, _ = experiment_state(t)
            params = " ".join(f"{p['name']}={p['value']}"
                              for p in t.get("spec", {}).get("parameterAssignments") or [])
            self.say(f"  {t['metadata']['name']}  {state}  {params}")

    def wait(self, name: str, timeout_s: float | None = None, poll_s: float = POLL_S) -> dict:
        """Poll until Succeeded (returns the Experiment, having said its best trial: `report`)
        or Failed (JobFailedError, naming the failed trials); WaitTimeoutError after
        `timeout_s`, leaving the Experiment running."""
        last = None

        def poll():
            nonlocal last
            experiment = self.get(name)
            state, message = experiment_state(experiment)
            line = f"{state}: {progress(experiment)}"
            if line != last:
                self.say(f"Experiment {self.namespace}/{name} {line}")
                last = line
            if state == "Failed":
                failed = [t["metadata"]["name"] for t in self.trials(name)
                          if experiment_state(t)[0] == "Failed"]
                raise JobFailedError(
                    f"Experiment {self.namespace}/{name} failed: {message or state}. Failed "
                    f"trials: {', '.join(failed) or 'none listed'} (kubectl describe trial "
                    f"NAME -n {self.namespace}; their job's logs: kfvision job logs NAME).")
            return experiment if state == "Succeeded" else None

        done = self.api.wait_for(poll, timeout_s, poll_s, lambda: WaitTimeoutError(
            f"Experiment {self.namespace}/{name} not finished after {timeout_s:g} s; it goes on "
            f"(kfvision tune status {name} -n {self.namespace}, kfvision tune delete {name} -n "
            f"{self.namespace})."))
        self.report(name, done)
        return done


def client(namespace: str | None = None, out=None) -> ExperimentClient:
    """An ExperimentClient for the current kubeconfig context (or the pod's service account)."""
    api = connect_api(namespace)
    api.out = out or api.out
    return ExperimentClient(api)

