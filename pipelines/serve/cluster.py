"""Apply, wait for and delete a KServe InferenceService through the Kubernetes API.

The kubernetes client's CustomObjectsApi on `serving.kserve.io/v1beta1` `inferenceservices`, as
for PyTorchJobs (pipelines/jobs/cluster.py): the plain dict `kfvision deploy render` builds, and
exactly these calls, which manifests/rbac-deploy.yaml grants:
    inferenceservices: create, patch (it exists already: update it), get (wait), delete
"""

import contextlib
import json
import sys
import time

from pipelines.jobs.errors import JobTimeoutError, KubernetesError

GROUP, VERSION, PLURAL, KIND = "serving.kserve.io", "v1beta1", "inferenceservices", \
    "InferenceService"
_HINTS = {
    403: "the service account may not do this: apply manifests/rbac-deploy.yaml to this "
         "namespace (docs/serving.md).",
    404: "is KServe installed (serving.kserve.io/v1beta1 InferenceService CRD), and is the "
         "namespace right?",
}


def _error(e: Exception, verb: str, namespace: str, name: str) -> KubernetesError:
    status = getattr(e, "status", None)
    detail = getattr(e, "reason", None) or str(e)
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        detail = json.loads(e.body).get("message", detail)
    hint = _HINTS.get(status, "check that the cluster is reachable (kubectl get nodes).")
    code = f"HTTP {status}: " if status else ""
    return KubernetesError(f"{verb} {KIND} {namespace}/{name} failed: {code}{detail}. {hint}",
                           status)


def ready_state(isvc: dict) -> tuple[bool, str]:
    """(ready, what to say) from the InferenceService's `Ready` condition and URL."""
    status = isvc.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == "Ready":
            if c.get("status") == "True":
                return True, f"ready at {status.get('url', '(no URL yet)')}"
            return False, c.get("message") or c.get("reason") or "not ready"
    return False, "no status yet (is the KServe controller running?)"


class DeployClient:
    """InferenceServices of one namespace; `custom`: kubernetes' CustomObjectsApi."""

    def __init__(self, custom, namespace: str, out=None, sleep=time.sleep,
                 clock=time.monotonic):
        self.custom, self.namespace = custom, namespace
        self.out, self.sleep, self.clock = out or sys.stdout, sleep, clock

    def _call(self, verb: str, name: str, fn, *args, **kwargs):
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(GROUP, VERSION, self.namespace, PLURAL, *args, **kwargs)
        except (ApiException, HTTPError) as e:
            raise _error(e, verb, self.namespace, name) from e

    def apply(self, isvc: dict) -> str:
        """Create the InferenceService, or update it when it exists; "created" or "updated"."""
        from kubernetes.client.exceptions import ApiException

        name = isvc["metadata"]["name"]
        body = {**isvc, "metadata": {**isvc["metadata"], "namespace": self.namespace}}
        try:
            self._call("create", name, self.custom.create_namespaced_custom_object, body)
            return "created"
        except KubernetesError as e:
            if not isinstance(e.__cause__, ApiException) or e.status != 409:
                raise
        self._call("patch", name, self.custom.patch_namespaced_custom_object, name, body)
        return "updated"

    def get(self, name: str) -> dict:
        return self._call("get", name, self.custom.get_namespaced_custom_object, name)

    def wait_ready(self, name: str, timeout: float, poll: float = 5.0) -> dict:
        """Poll until `Ready` is True (returns the object); JobTimeoutError after `timeout`."""
        deadline, said = self.clock() + timeout, None
        while True:
            isvc = self.get(name)
            ready, what = ready_state(isvc)
            if what != said:
                print(f"InferenceService {self.namespace}/{name}: {what}", file=self.out,
                      flush=True)
                said = what
            if ready:
                return isvc
            if self.clock() >= deadline:
                raise JobTimeoutError(
                    f"InferenceService {self.namespace}/{name} was not Ready after {timeout:g} s "
                    f"({what}). Look at `kubectl describe inferenceservice {name} -n "
                    f"{self.namespace}` and the predictor pod's log.")
            self.sleep(poll)

    def delete(self, name: str) -> None:
        self._call("delete", name, self.custom.delete_namespaced_custom_object, name)


def connect(namespace: str | None = None, out=None) -> DeployClient:
    """A DeployClient for the current kubeconfig (or in-cluster) configuration, as `job submit`
    finds it (pipelines/jobs/cluster.py)."""
    from pipelines.jobs import cluster

    jobs = cluster.connect(namespace, out)
    return DeployClient(jobs.custom, jobs.namespace, out=out)
