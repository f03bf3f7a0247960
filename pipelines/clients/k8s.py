"""The one Kubernetes layer: connecting, the API calls kfvision makes, what their failures mean,
create-or-re-attach, and waiting. Jobs (pipelines/jobs/jobclient.py), InferenceServices
(pipelines/serve/deployclient.py) and Katib Experiments (pipelines/tune/experimentclient.py) all
go through `Api`; no other module imports the `kubernetes` package.

We use the `kubernetes` client's CustomObjectsApi (the objects as the plain dicts our renderers
build and the CRD schemas check) and CoreV1Api (pods, logs, claims), not the operators' SDKs: no
second model of each object to keep in step, and every call is one we choose, so each failure can
name kind/namespace/name and the Roles in manifests/ can list exactly these verbs.

One mapping of failures, whichever command made the call (docs/cli.md, "Errors"):
    nothing answered, timed out   EndpointUnreachableError  69  (pipelines/clients/endpoints.py)
    TLS handshake failed          EndpointTLSError          76
    credentials refused (401)     EndpointAuthError         77
    any other refusal (403, 404,  KubernetesError            4   names kind/namespace/name and
    409, 422, 5xx)                                               says what to do
A 403 stays a KubernetesError: the server knew who we are, the Role is what is missing.

Importing this module does not import `kubernetes` (that costs ~0.5 s): `connect` and the error
mapping import it when they run, so `kfvision job render` never pays for it.
"""

import contextlib
import json
import logging
import math
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from kfvision.pipelines.clients.endpoints import EndpointAuthError, EndpointError, endpoint_error
from kfvision.trainer.errors import KfvisionError

# NVIDIA's device plugin resource (github.com/NVIDIA/k8s-device-plugin, `nvidia.com/gpu`)
GPU_RESOURCE = "nvidia.com/gpu"
# Where a pod finds its own namespace (the service account volume kubelet mounts)
POD_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
RBAC_HINT = ("the service account may not do this: apply the Role and RoleBinding in "
             "manifests/rbac.yaml to this namespace (see docs/jobs.md, 'RBAC').")
AUTH_HINT = "refresh the kubeconfig (or the pod's service account token)."

# Kubernetes name rules (apimachinery validation: IsDNS1035Label, IsDNS1123Label/Subdomain)
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def dns1035_problem(what: str, value) -> str | None:
    """Why `value` is not a DNS-1035 label (what Service and PyTorchJob names must be), or None."""
    if not isinstance(value, str) or not _DNS1035.fullmatch(value) or len(value) > 63:
        return (f"{what} {value!r} is not a DNS-1035 label: use at most 63 lower-case letters, "
                "digits and '-', starting with a letter and ending with a letter or digit")
    return None


def dns1123_problem(what: str, value, subdomain: bool = False) -> str | None:
    """Why `value` is not a DNS-1123 label (or subdomain), or None."""
    pattern, limit = (_DNS1123_SUBDOMAIN, 253) if subdomain else (_DNS1123_LABEL, 63)
    if not isinstance(value, str) or not pattern.fullmatch(value) or len(value) > limit:
        kind = "subdomain" if subdomain else "label"
        return (f"{what} {value!r} is not a DNS-1123 {kind}: use at most {limit} lower-case "
                "letters, digits and '-'" + (" (and '.')" if subdomain else "")
                + ", starting and ending with a letter or digit")
    return None


def quantity(text) -> int:
    """A Kubernetes quantity as resource.Quantity.Value() gives it: rounded up (1500m -> 2).
    Plain numbers and millis only (what CPU and GPU counts are written as); ValueError else."""
    text = str(text).strip()
    return math.ceil(int(text[:-1]) / 1000 if text.endswith("m") else float(text))


class KubernetesError(KfvisionError):
    """The Kubernetes API refused or failed a request; names kind/namespace/name. `status`: the
    HTTP status when the API server answered (404: no such object), else None."""

    exit_code = 4

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class WaitTimeoutError(KfvisionError):
    """Waiting for an object (a job, an InferenceService, an Experiment) took longer than the
    caller allowed; the message says whether it was left running."""

    exit_code = 124  # what timeout(1) returns


@dataclass(frozen=True)
class Resource:
    """A custom resource kfvision creates: where the API serves it and what to say when the
    cluster lacks it (`install`) or the service account may not use it (`rbac`)."""

    kind: str
    group: str
    version: str
    plural: str
    install: str  # how to get the CRD ("install ...")
    rbac: str = RBAC_HINT

    @property
    def crd(self) -> str:
        return f"{self.plural}.{self.group}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


def _http_errors() -> tuple:
    """The exceptions a kubernetes client call raises: an answer (ApiException) or none
    (urllib3's HTTPError: refused, reset, timed out, TLS)."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    return ApiException, HTTPError


def _detail(e: Exception) -> str:
    detail = getattr(e, "reason", None) or str(e)
    body = getattr(e, "body", None)
    if body:
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            detail = json.loads(body).get("message", detail)
    return detail


def api_error(e: Exception, verb: str, kind: str, namespace: str, name: str, host: str,
              resource: Resource | None = None) -> KubernetesError | EndpointError:
    """The named error of a failed API call (see the module docstring for the mapping).

    Args:
        resource: the custom resource the call was about, for its install and RBAC hints.
    """
    status = getattr(e, "status", None)
    if status is None:
        unreachable = endpoint_error(
            e, host, "the Kubernetes API", check="the kubeconfig context (`kubectl config "
            "current-context`, `kubectl get nodes`) and any port-forward or VPN it needs",
            auth_check=AUTH_HINT)
        if unreachable is not None:
            return unreachable
    if status == 401:
        return EndpointAuthError(f"{verb} {kind} {namespace}/{name} failed: HTTP 401: the "
                                 f"Kubernetes API at {host} refused the credentials: {AUTH_HINT}",
                                 host)
    hint = "check that the cluster is reachable (kubectl get nodes)."
    if status == 403:
        hint = resource.rbac if resource else RBAC_HINT
    elif status == 404 and verb == "create" and resource is not None:
        hint = (f"is the {resource.kind} CRD ({resource.crd}) installed, and is the namespace "
                f"right? If not, {resource.install}.")
    elif status == 404:
        hint = (f"there is no {kind} {name} in namespace {namespace}: check the name and "
                "namespace (or that its CRD is installed).")
    code = f"HTTP {status}: " if status else ""
    return KubernetesError(f"{verb} {kind} {namespace}/{name} failed: {code}{_detail(e)}. {hint}",
                           status)


def connect(namespace: str | None = None) -> "Api":
    """An Api for the current kubeconfig context, or the in-cluster configuration inside a pod.

    The namespace is `namespace`, else the context's (or the pod's own), else "default".
    Raises:
        KubernetesError: no usable configuration.
    """
    from kubernetes import client, config

    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
            current = (Path(POD_NAMESPACE_FILE).read_text(encoding="utf-8").strip()
                       if os.path.exists(POD_NAMESPACE_FILE) else None)
        else:
            # KUBECONFIG as it is now (the client reads it once, when first imported)
            path = os.environ.get("KUBECONFIG") or None
            config.load_kube_config(config_file=path)
            _, active = config.list_kube_config_contexts(config_file=path)
            current = (active or {}).get("context", {}).get("namespace")
    except (config.ConfigException, OSError) as e:
        raise KubernetesError(f"no Kubernetes configuration: {e}. Set KUBECONFIG or run "
                              "`kubectl config use-context ...` (inside a pod, the service "
                              "account is used).") from e
    # urllib3 retries a refused connection three times, each with a WARNING on stderr; the
    # failure that remains is reported once, as a named error (api_error)
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    host = client.Configuration.get_default_copy().host or "the Kubernetes API server"
    return Api(client.CustomObjectsApi(), client.CoreV1Api(), namespace or current or "default",
               host=host)


class Api:
    """The calls kfvision makes in one namespace, each failure mapped by `api_error`.

    `custom`, `core`: kubernetes' CustomObjectsApi and CoreV1Api (tests pass a fake of both);
    `out`: where progress lines go; `sleep`, `clock`: injected so that waiting can be tested
    without waiting.
    """

    def __init__(self, custom, core, namespace: str, *, host: str = "the Kubernetes API server",
                 out=None, sleep=time.sleep, clock=time.monotonic):
        self.custom, self.core, self.namespace, self.host = custom, core, namespace, host
        self.out, self.sleep, self.clock = out or sys.stdout, sleep, clock
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        """One progress line (threads that stream logs share `out`)."""
        with self._lock:
            self.out.write(line + "\n")
            self.out.flush()

    def call(self, verb: str, kind: str, name: str, fn, *args,
             resource: Resource | None = None, **kwargs):
        """fn(*args, **kwargs), its failure raised as the named error (from the client's)."""
        api_exception, http_error = _http_errors()
        try:
            return fn(*args, **kwargs)
        except (api_exception, http_error) as e:
            raise api_error(e, verb, kind, self.namespace, name, self.host, resource) from e

    # custom objects of this namespace
    def _where(self, r: Resource) -> tuple:
        return r.group, r.version, self.namespace, r.plural

    def create(self, r: Resource, body: dict) -> tuple:
        """Create `body`; when one of that name exists (409), return it instead: launchers are
        idempotent, a retried step re-attaches. -> (object, created)."""
        name = body["metadata"]["name"]
        body = {**body, "metadata": {**body["metadata"], "namespace": self.namespace}}
        try:
            return self.call("create", r.kind, name, self.custom.create_namespaced_custom_object,
                             *self._where(r), body, resource=r), True
        except KubernetesError as e:
            if e.status != 409:  # 409 Conflict: AlreadyExists
                raise
        return self.get(r, name), False

    def get(self, r: Resource, name: str) -> dict:
        return self.call("get", r.kind, name, self.custom.get_namespaced_custom_object,
                         *self._where(r), name, resource=r)

    def patch(self, r: Resource, name: str, body: dict) -> dict:
        body = {**body, "metadata": {**body["metadata"], "namespace": self.namespace}}
        return self.call("patch", r.kind, name, self.custom.patch_namespaced_custom_object,
                         *self._where(r), name, body, resource=r)

    def delete(self, r: Resource, name: str) -> None:
        """Delete; owner references take what the object made (pods, trials) along."""
        self.call("delete", r.kind, name, self.custom.delete_namespaced_custom_object,
                  *self._where(r), name, propagation_policy="Background", resource=r)

    def list(self, r: Resource, selector: str) -> list:
        """The objects of `r` with label `selector`, by name."""
        listed = self.call("list", r.kind, f"-l {selector}",
                           self.custom.list_namespaced_custom_object, *self._where(r),
                           label_selector=selector, resource=r)
        return sorted(listed.get("items") or [], key=lambda o: o["metadata"]["name"])

    def get_cluster_scoped(self, r: Resource, name: str) -> dict:
        return self.call("get", r.kind, name, self.custom.get_cluster_custom_object, r.group,
                         r.version, r.plural, name, resource=r)

    def served(self, group: str, version: str) -> set:
        """The plural names the API server serves under group/version (discovery, which every
        authenticated user may read); empty when the group/version is not served at all."""
        api_exception, http_error = _http_errors()
        try:
            resp = self.custom.get_api_resources(group, version, _preload_content=False)
        except (api_exception, http_error) as e:
            if getattr(e, "status", None) == 404:
                return set()
            error = api_error(e, "discover", "API group", self.namespace, group, self.host)
            if isinstance(error, KubernetesError):  # the object is a group, not ns/name
                error = KubernetesError(f"API discovery of {group}/{version} failed: "
                                        f"HTTP {e.status}: {_detail(e)}", e.status)
            raise error from e
        return {r.get("name") for r in json.loads(resp.data).get("resources") or []}

    # pods, their logs, claims
    def _core_json(self, verb: str, kind: str, name: str, fn, *args, **kwargs) -> dict:
        resp = self.call(verb, kind, name, fn, *args, _preload_content=False, **kwargs)
        return json.loads(resp.data)

    def pods(self, selector: str) -> list:
        """The pods with label `selector` as dicts, by name."""
        items = self._core_json("list", "Pod", f"-l {selector}", self.core.list_namespaced_pod,
                                self.namespace, label_selector=selector)["items"]
        return sorted(items, key=lambda p: p["metadata"]["name"])

    def create_config_map(self, body: dict) -> tuple:
        """Create the ConfigMap `body`, or reuse the one of that name: a user's source snapshot,
        immutable and named by its sha256, so one name always holds the same bytes.
        -> (object, created)."""
        name = body["metadata"]["name"]
        body = {**body, "metadata": {**body["metadata"], "namespace": self.namespace}}
        try:
            return self._core_json("create", "ConfigMap", name,
                                   self.core.create_namespaced_config_map, self.namespace,
                                   body), True
        except KubernetesError as e:
            if e.status != 409:  # 409 Conflict: AlreadyExists
                raise
        return self._core_json("get", "ConfigMap", name, self.core.read_namespaced_config_map,
                               name, self.namespace), False

    def pod(self, name: str) -> dict:
        return self._core_json("get", "Pod", name, self.core.read_namespaced_pod, name,
                               self.namespace)

    def claim(self, name: str) -> dict:
        return self._core_json("get", "PersistentVolumeClaim", name,
                               self.core.read_namespaced_persistent_volume_claim, name,
                               self.namespace)

    def pod_log(self, pod: str, container: str, tail: int | None = None,
                previous: bool = False, timestamps: bool = False) -> str:
        """The container's log; with `timestamps`, each line starts with the kubelet's RFC 3339
        time and a space."""
        kwargs = {"tail_lines": tail} if tail else {}
        if timestamps:
            kwargs["timestamps"] = True
        resp = self.call("read log of", "Pod", pod, self.core.read_namespaced_pod_log, pod,
                         self.namespace, container=container, previous=previous,
                         _preload_content=False, **kwargs)
        return resp.data.decode("utf-8", errors="replace")

    def follow_log(self, pod: str, container: str):
        """The container's log, raw chunks as they are written, until it ends."""
        resp = self.call("follow log of", "Pod", pod, self.core.read_namespaced_pod_log, pod,
                         self.namespace, container=container, follow=True,
                         _preload_content=False)
        api_exception, http_error = _http_errors()
        try:
            yield from resp.stream(amt=None, decode_content=False)
        except (api_exception, http_error) as e:
            raise api_error(e, "follow log of", "Pod", self.namespace, pod, self.host) from e
        finally:
            resp.release_conn()

    def wait_for(self, poll, timeout_s: float | None, poll_s: float, timed_out):
        """Call `poll()` every `poll_s` seconds until it returns something other than None
        (returned). `poll` may raise to end the wait (a failed job). Once `timeout_s` has passed
        (None: no limit), raise `timed_out()`, a WaitTimeoutError that says where things stand.
        """
        start = self.clock()
        while True:
            result = poll()
            if result is not None:
                return result
            if timeout_s is not None and self.clock() - start >= timeout_s:
                raise timed_out()
            self.sleep(poll_s)


class _Dumper(yaml.SafeDumper):
    """Block style, lists indented under their key (as kubectl and most manifests write them)."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)

    def ignore_aliases(self, data):  # never &id001 anchors, even for a shared sub-dict
        return True


def to_yaml(manifest: dict, header: str | None = None) -> str:
    """Deterministic YAML of a manifest (key order as built), with optional `# header` lines:
    what every `render` command and step writes."""
    text = yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
    if header:
        text = "".join(f"# {line}\n" for line in header.splitlines()) + text
    return text
