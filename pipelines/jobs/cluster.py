"""Run a PyTorchJob or TrainJob on a cluster through the Kubernetes API: submit, wait, logs,
delete. What differs between the two kinds (API group, pod labels, container, success) is read
from their JobKind (pipelines/jobs/kinds.py).

We talk to the API with the `kubernetes` client's CustomObjectsApi (the job, as the plain dict
`kfvision job render` builds and the CRD schema checks) and CoreV1Api (its pods and their logs),
not the Training Operator SDK: one dependency fewer, no second model of the job to keep in step
with the manifest, and every call is one we choose, so each error can name kind/namespace/name
and the Role in manifests/ can list exactly these verbs:
    pytorchjobs, trainjobs: create, get, delete    pods: list    pods/log: get
    clustertrainingruntimes, trainingruntimes: get (submit checks a TrainJob's runtime exists)

The launcher is idempotent: submitting a job that already exists re-attaches to it.
"""

import contextlib
import json
import sys
import threading
import time
from pathlib import Path

from pipelines.connect import EndpointError, endpoint_error
from pipelines.jobs.errors import JobFailedError, JobTimeoutError, KubernetesError
from pipelines.jobs.kinds import KINDS, PYTORCHJOB, TRAINJOB, JobKind
from pipelines.jobs.podstatus import (
    container_status,
    job_state,
    pod_problems,
    split_lines,
)

_HINTS = {
    401: "your credentials were refused: refresh the kubeconfig (or the pod's service account "
         "token).",
    403: "the service account may not do this: apply the Role and RoleBinding in "
         "manifests/rbac.yaml to this namespace (see docs/jobs.md, 'RBAC').",
}


def _api_host() -> str:
    from kubernetes import client

    return client.Configuration.get_default_copy().host or "the Kubernetes API server"


def api_error(e: Exception, verb: str, kind: str, namespace: str,
              name: str) -> KubernetesError | EndpointError:
    """A KubernetesError for a failed API call that names the object and says what to do; an
    EndpointError naming the API server when it could not be reached (pipelines/connect.py)."""
    status = getattr(e, "status", None)
    if status is None:
        unreachable = endpoint_error(
            e, _api_host(), "the Kubernetes API", check="the kubeconfig context (`kubectl config "
            "current-context`, `kubectl get nodes`) and any port-forward or VPN it needs",
            auth_check=_HINTS[401])
        if unreachable is not None:
            return unreachable
    detail = getattr(e, "reason", None) or str(e)
    body = getattr(e, "body", None)
    if body:
        with contextlib.suppress(ValueError, AttributeError):
            detail = json.loads(body).get("message", detail)
    hint = _HINTS.get(status, "check that the cluster is reachable (kubectl get nodes).")
    if status == 404 and kind in KINDS:  # on create: the CRD is missing (or the namespace)
        hint = (f"is the {kind} CRD ({KINDS[kind].crd}) installed, and is the namespace right? "
                f"If not, {KINDS[kind].install}.")
    if status == 404 and verb != "create":
        hint = (f"there is no {kind} {name} in namespace {namespace}: check the name and "
                "namespace (or that the job's CRD is installed).")
    code = f"HTTP {status}: " if status else ""
    return KubernetesError(f"{verb} {kind} {namespace}/{name} failed: {code}{detail}. {hint}",
                           status)


def _http_errors() -> tuple:
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    return ApiException, HTTPError


def connect(namespace: str | None = None, out=None, kind: JobKind = PYTORCHJOB) -> "JobClient":
    """A JobClient (of `kind`) for the current kubeconfig context, or the in-cluster config
    inside a pod.

    The namespace is `namespace`, else the context's (or the pod's own), else "default".
    Raises:
        KubernetesError: no usable configuration.
    """
    import os

    from kubernetes import client, config

    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
            ns_file = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
            current = (Path(ns_file).read_text(encoding="utf-8").strip()
                       if os.path.exists(ns_file) else None)
        else:
            config.load_kube_config()
            _, active = config.list_kube_config_contexts()
            current = (active or {}).get("context", {}).get("namespace")
    except (config.ConfigException, OSError) as e:
        raise KubernetesError(f"no Kubernetes configuration: {e}. Set KUBECONFIG or run "
                              "`kubectl config use-context ...` (inside a pod, the service "
                              "account is used).") from e
    return JobClient(client.CustomObjectsApi(), client.CoreV1Api(),
                     namespace or current or "default", out=out, kind=kind)


class JobClient:
    """Jobs of one kind in one namespace. `custom`/`core`: kubernetes' CustomObjectsApi and
    CoreV1Api; `kind`: PYTORCHJOB or TRAINJOB."""

    def __init__(self, custom, core, namespace: str, out=None, sleep=time.sleep,
                 clock=time.monotonic, kind: JobKind = PYTORCHJOB):
        self.custom, self.core, self.namespace, self.kind = custom, core, namespace, kind
        self.out, self.sleep, self.clock = out or sys.stdout, sleep, clock
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        with self._lock:
            self.out.write(line + "\n")
            self.out.flush()

    def _call(self, verb: str, kind: str, name: str, fn, *args, **kwargs):
        api_exception, http_error = _http_errors()
        try:
            return fn(*args, **kwargs)
        except (api_exception, http_error) as e:
            raise api_error(e, verb, kind, self.namespace, name) from e

    def create(self, job: dict) -> tuple:
        """Create `job`; if it already exists, return that one instead. -> (object, created)."""
        api_exception, http_error = _http_errors()
        name = job["metadata"]["name"]
        body = {**job, "metadata": {**job["metadata"], "namespace": self.namespace}}
        try:
            return self.custom.create_namespaced_custom_object(
                *self._where(), body), True
        except api_exception as e:
            if e.status != 409:  # 409 Conflict: AlreadyExists -> re-attach below
                raise api_error(e, "create", self.kind.kind, self.namespace, name) from e
        except http_error as e:
            raise api_error(e, "create", self.kind.kind, self.namespace, name) from e
        return self.get(name), False

    def get(self, name: str) -> dict:
        return self._call("get", self.kind.kind, name, self.custom.get_namespaced_custom_object,
                          *self._where(), name)

    def _where(self) -> tuple:
        return self.kind.group, self.kind.version, self.namespace, self.kind.plural

    def delete(self, name: str) -> None:
        """Delete the job; the operator's owner references take its pods and services along."""
        self._call("delete", self.kind.kind, name, self.custom.delete_namespaced_custom_object,
                   *self._where(), name,
                   propagation_policy="Background")

    def pods(self, name: str) -> list:
        """The job's pods as dicts (from the operator's job-name label), by name."""
        selector = f"{self.kind.pod_label}={name}"
        resp = self._call("list", "Pod", f"-l {selector}", self.core.list_namespaced_pod,
                          self.namespace, label_selector=selector,
                          _preload_content=False)
        return sorted(json.loads(resp.data)["items"], key=lambda p: p["metadata"]["name"])

    def pod_log(self, pod: str, tail: int | None = None, previous: bool = False) -> str:
        kwargs = {"tail_lines": tail} if tail else {}
        resp = self._call("read log of", "Pod", pod, self.core.read_namespaced_pod_log, pod,
                          self.namespace, container=self.kind.container, previous=previous,
                          _preload_content=False, **kwargs)
        return resp.data.decode("utf-8", errors="replace")

    def follow_log(self, pod: str):
        """The pod's `pytorch` log line by line as it is written, until the container ends."""
        resp = self._call("follow log of", "Pod", pod, self.core.read_namespaced_pod_log, pod,
                          self.namespace, container=self.kind.container, follow=True,
                          _preload_content=False)
        try:
            yield from split_lines(resp.stream(amt=None, decode_content=False))
        finally:
            resp.release_conn()

    def own_claims(self, pod: str) -> dict:
        """{mount path: PVC name} of the volumes the pod `pod` (this step's own: its name is
        its HOSTNAME) mounts in its containers: the job's pods mount the same claims to see
        the step's files at the same paths."""
        resp = self._call("get", "Pod", pod, self.core.read_namespaced_pod, pod, self.namespace,
                          _preload_content=False)
        spec = json.loads(resp.data)["spec"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in spec.get("volumes") or [] if v.get("persistentVolumeClaim")}
        return {m["mountPath"]: claims[m["name"]] for c in spec.get("containers") or []
                for m in c.get("volumeMounts") or [] if m["name"] in claims}

    def access_modes(self, claim: str) -> list:
        """The access modes PVC `claim` was bound with (those it asked for, while unbound)."""
        resp = self._call("get", "PersistentVolumeClaim", claim,
                          self.core.read_namespaced_persistent_volume_claim, claim,
                          self.namespace, _preload_content=False)
        pvc = json.loads(resp.data)
        return (pvc.get("status") or {}).get("accessModes") or pvc["spec"].get("accessModes", [])

    def find_pod(self, name: str, replica: str) -> dict | None:
        return next((p for p in self.pods(name) if self.kind.replica_name(p) == replica), None)

    def failure_report(self, name: str, job: dict, tail: int = 20) -> str:
        """Which replica failed, why (exit code, reason), and its last log lines."""
        _, message = job_state(job)
        lines = [f"{self.kind.kind} {self.namespace}/{name} failed: {message}"]
        for pod in self.pods(name):
            status = container_status(pod, self.kind)
            now = (status.get("state") or {}).get("terminated")
            before = (status.get("lastState") or {}).get("terminated")
            ended = now or before
            if not ended or ended.get("exitCode", 0) == 0:
                continue
            pod_name = pod["metadata"]["name"]
            lines.append(f"  {self.kind.replica_name(pod)} (pod {pod_name}) exited with code "
                         f"{ended.get('exitCode')}, reason {ended.get('reason', 'unknown')}"
                         + (f": {ended['message'].strip()}" if ended.get("message") else ""))
            try:
                log = self.pod_log(pod_name, tail=tail, previous=not now)
            except KubernetesError as e:  # the report must still say which replica failed
                log = f"(no log: {e})"
            lines += [f"    {line}" for line in log.rstrip("\n").splitlines()[-tail:]]
        if len(lines) == 1:
            lines.append("  no pod of it ended with a non-zero exit code (deleted, or the job "
                         f"failed before its pods ran: see `kubectl describe {self.kind.plural} "
                         f"{name} -n {self.namespace}`)")
        return "\n".join(lines)

    def _follow(self, pod: str, prefix: str) -> None:
        api_exception, http_error = _http_errors()
        try:
            for line in self.follow_log(pod):
                self.say(f"[{prefix}] {line}")
        except (KubernetesError, api_exception, http_error) as e:
            self.say(f"[{prefix}] (log stream ended: {e})")

    def _keep_following(self, name: str, seen: set, current):
        """(Re)start streaming the Master's log once its container runs, once per container."""
        if current is not None and current.is_alive():
            return current
        pod = self.find_pod(name, self.kind.primary)
        status = container_status(pod or {}, self.kind)
        state = status.get("state") or {}
        if not pod or not (state.get("running") or state.get("terminated")):
            return current
        key = (pod["metadata"].get("uid"), status.get("restartCount", 0))
        if key in seen:
            return current
        seen.add(key)
        thread = threading.Thread(target=self._follow, name=f"log-{name}", daemon=True,
                                  args=(pod["metadata"]["name"], self.kind.primary))
        thread.start()
        return thread

    def wait(self, name: str, timeout_s: float | None = None, poll_s: float = 10.0,
             logs: bool = True) -> dict:
        """Poll the job's conditions until Succeeded (returns the job) or Failed (raises),
        streaming the Master's log meanwhile.

        Raises:
            JobFailedError: the job failed; names the failing replica, reason and last log lines.
            JobTimeoutError: `timeout_s` passed first (the job is left as it is).
            KubernetesError: an API call failed.
        """
        start, seen, follower, last = self.clock(), set(), None, None
        while True:
            job = self.get(name)
            state, message = job_state(job)
            if state != last:
                self.say(f"{self.kind.kind} {self.namespace}/{name}: {state}"
                         + (f" ({message})" if message else ""))
                last = state
            if logs:
                follower = self._keep_following(name, seen, follower)
            if state in (self.kind.succeeded, "Failed"):
                if follower is not None:
                    follower.join(timeout=10)  # let the last lines of the log through
                if state == "Failed":
                    raise JobFailedError(self.failure_report(name, job))
                return job
            if timeout_s is not None and self.clock() - start >= timeout_s:
                pending = pod_problems(self.pods(name), self.kind)
                raise JobTimeoutError(
                    f"{self.kind.kind} {self.namespace}/{name} did not finish within "
                    f"{timeout_s:g} s (state {state})." + "".join(f"\n  {p}" for p in pending))
            self.sleep(poll_s)


def submit(client: JobClient, job: dict, *, wait: bool = False, timeout_s: float | None = None,
           keep_on_timeout: bool = False, poll_s: float = 10.0, logs: bool = True) -> dict:
    """Create `job` (or re-attach to the one of that name) and optionally wait for it.

    On a timeout the job is deleted (its GPUs freed) unless `keep_on_timeout`.
    Returns:
        the job object (final, when waiting).
    Raises:
        JobFailedError, JobTimeoutError, KubernetesError: see JobClient.wait.
    """
    name = job["metadata"]["name"]
    if client.kind is TRAINJOB:
        check_runtime(client, job)
    obj, created = client.create(job)
    where = f"{client.kind.kind} {client.namespace}/{name}"
    state = job_state(obj)[0]
    if created:
        client.say(f"created {where}")
    elif state in (client.kind.succeeded, "Failed"):  # e.g. submitted again after a fix
        client.say(f"{where} already exists and has {state.lower()}: reporting that run (no new "
                   f"job is created). To run it again: kfvision job delete {name} -n "
                   f"{client.namespace}, then submit.")
    else:
        client.say(f"{where} already exists: re-attaching to it (no second job is created)")
    if not wait:
        return obj
    try:
        return client.wait(name, timeout_s=timeout_s, poll_s=poll_s, logs=logs)
    except JobTimeoutError as e:
        if keep_on_timeout:
            raise JobTimeoutError(f"{e}\nIt is still there (--keep-on-timeout): "
                                  f"kfvision job delete {name} -n {client.namespace}") from e
        client.delete(name)
        raise JobTimeoutError(f"{e}\nDeleted it (pass --keep-on-timeout to keep it).") from e


def attach(client: JobClient, name: str) -> JobClient:
    """A client of the kind that has a job `name` (TrainJob first), for logs and delete.

    Raises:
        KubernetesError: neither a TrainJob nor a PyTorchJob of that name (status 404), or the
            first refusal (e.g. 403: a Role of an older kfvision grants only pytorchjobs).
    """
    refused = None
    for kind in (TRAINJOB, PYTORCHJOB):
        other = JobClient(client.custom, client.core, client.namespace, client.out,
                          client.sleep, client.clock, kind)
        try:
            other.get(name)
        except KubernetesError as e:
            if e.status not in (403, 404):
                raise
            refused = refused or (e if e.status == 403 else None)
            continue
        return other
    if refused is not None:
        raise refused
    raise KubernetesError(f"there is no TrainJob or PyTorchJob {name} in namespace "
                          f"{client.namespace}: check the name and namespace (`kubectl get "
                          "trainjobs,pytorchjobs`).", 404)


def check_runtime(client: JobClient, job: dict) -> None:
    """Raise KubernetesError when the runtime a TrainJob references is missing (the webhook
    would refuse the job with a less helpful message); a 403 leaves the check to the webhook."""
    api_exception, http_error = _http_errors()
    ref = job["spec"]["runtimeRef"]
    kind, name = ref.get("kind") or "ClusterTrainingRuntime", ref["name"]
    plural = kind.lower() + "s"
    try:
        if kind == "TrainingRuntime":
            client.custom.get_namespaced_custom_object(TRAINJOB.group, TRAINJOB.version,
                                                       client.namespace, plural, name)
        else:
            client.custom.get_cluster_custom_object(TRAINJOB.group, TRAINJOB.version, plural,
                                                    name)
    except api_exception as e:
        if e.status == 403:
            return
        if e.status != 404:
            raise api_error(e, "get", kind, client.namespace, name) from e
        where = f" in namespace {client.namespace}" if kind == "TrainingRuntime" else ""
        how = (f"kubectl apply -f manifests/trainer-v2/{kind.lower()}.yaml"
               + (f" -n {client.namespace}" if where else "")
               if name == "kfvision-torch" else
               "install Kubeflow Trainer's runtimes (kubectl apply --server-side -k "
               "\"github.com/kubeflow/trainer.git/manifests/overlays/runtimes?ref=v2.3.0\")")
        raise KubernetesError(
            f"TrainJob {client.namespace}/{job['metadata']['name']} references {kind} {name}, "
            f"which the cluster does not have{where}: {how}, or render with another --runtime "
            "(`kubectl get clustertrainingruntimes,trainingruntimes -A` lists them).",
            404) from e
    except http_error as e:
        raise api_error(e, "get", kind, client.namespace, name) from e
