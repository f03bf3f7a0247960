"""Apply, wait for and delete a KServe InferenceService, through pipelines/clients/k8s.py (which
maps every failure the same way for jobs, Experiments and InferenceServices). `DeployClient`
speaks the verbs every cluster client does (pipelines/clients/cluster.py); a timeout leaves the
InferenceService as it is. Exactly these calls, which manifests/rbac-deploy.yaml grants:
    inferenceservices: create, patch (it exists already: update it), get (wait), delete
"""

from kfvision.pipelines.clients.cluster import POLL_S, ClusterClient
from kfvision.pipelines.clients.k8s import Resource, WaitTimeoutError
from kfvision.pipelines.clients.k8s import connect as connect_api
from kfvision.pipelines.serve.deploy import API_VERSION, KIND, MODEL_LOADED, READY_CONDITION

GROUP, VERSION = API_VERSION.split("/")
INFERENCE_SERVICE = Resource(
    kind=KIND, group=GROUP, version=VERSION, plural="inferenceservices",
    install="install KServe (serving.kserve.io/v1beta1 InferenceService CRD; "
    "https://kserve.github.io/website/docs/admin-guide/overview)",
    rbac="the service account may not do this: apply manifests/rbac-deploy.yaml to this "
    "namespace (docs/serving.md).")


def ready_state(isvc: dict) -> tuple[bool, str]:
    """(ready, what to say) from the InferenceService's `Ready` condition and URL, and its
    model's state: `Ready` has been seen True before any model was loaded, so a model state
    other than Loaded (when the controller reports one) is not ready yet."""
    status = isvc.get("status") or {}
    model = ((status.get("modelStatus") or {}).get("states") or {}).get("activeModelState")
    for c in status.get("conditions") or []:
        if c.get("type") == READY_CONDITION:
            if c.get("status") != "True":
                return False, c.get("message") or c.get("reason") or "not ready"
            if model and model != MODEL_LOADED:
                failure = (status.get("modelStatus") or {}).get("lastFailureInfo") or {}
                return False, f"Ready, but its model is {model}" + (
                    f": {failure.get('message')}" if failure.get("message") else "")
            return True, f"ready at {status.get('url', '(no URL yet)')}"
    return False, "no status yet (is the KServe controller running?)"


class DeployClient(ClusterClient):
    """InferenceServices of one namespace, through `api` (a kfvision.pipelines.clients.k8s.Api)."""

    what, command = KIND, "deploy"

    def _apply(self, isvc: dict) -> tuple:
        obj, created = self.api.create(INFERENCE_SERVICE, isvc)
        if created:
            return obj, "created"
        return self.api.patch(INFERENCE_SERVICE, isvc["metadata"]["name"], isvc), "updated"

    def apply(self, isvc: dict) -> str:
        """Create the InferenceService, or update it when it exists; "created" or "updated"."""
        return self._apply(isvc)[1]

    def submit(self, isvc: dict) -> dict:
        """Create or update the InferenceService, saying which."""
        obj, how = self._apply(isvc)
        self.say(f"{how} {self.where(isvc['metadata']['name'])}")
        return obj

    def get(self, name: str) -> dict:
        return self.api.get(INFERENCE_SERVICE, name)

    def wait(self, name: str, timeout_s: float | None = None, poll_s: float = POLL_S) -> dict:
        """Poll until `Ready` is True (returns the object); WaitTimeoutError after `timeout_s`
        (None: no limit), the InferenceService left as it is."""
        said = what = None

        def ready():
            nonlocal said, what
            isvc = self.get(name)
            ok, what = ready_state(isvc)
            if what != said:
                self.api.say(f"InferenceService {self.namespace}/{name}: {what}")
                said = what
            return isvc if ok else None

        return self.api.wait_for(ready, timeout_s, poll_s, lambda: WaitTimeoutError(
            f"InferenceService {self.namespace}/{name} was not Ready after {timeout_s:g} s "
            f"({what}); it is left as it is. Look at `kubectl describe inferenceservice {name} "
            f"-n {self.namespace}` and the predictor pod's log (kfvision deploy delete {name} -n "
            f"{self.namespace} removes it)."))

    wait_ready = wait  # the pipeline's deploy step's name for it

    def delete(self, name: str) -> None:
        self.api.delete(INFERENCE_SERVICE, name)


def connect(namespace: str | None = None, out=None) -> DeployClient:
    """A DeployClient for the current kubeconfig (or in-cluster) configuration."""
    api = connect_api(namespace)
    api.out = out or api.out
    return DeployClient(api)
