"""Checks of rendered Kubernetes objects that several test files make: fields a CRD's structural
schema would drop, what the "restricted" Pod Security Standard refuses, the pods of a job.

The Pod Security checker follows https://kubernetes.io/docs/concepts/security/pod-security-standards/
(v1.30: the Baseline controls, then the Restricted ones); tests/jobs/test_least_privilege.py shows
that it refuses what the API server would."""


from helpers.paths import reference_yaml


def unknown_fields(obj, schema: dict, path: str = "") -> list:
    """Fields of `obj` the structural schema does not declare (the API server would drop them)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(obj, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for k, v in obj.items():
            if props is not None and k in props:
                found += unknown_fields(v, props[k], f"{path}.{k}")
            elif isinstance(extra, dict):
                found += unknown_fields(v, extra, f"{path}.{k}")
            elif props is not None:
                found.append(f"{path}.{k}")
    elif isinstance(obj, list) and "items" in schema:
        for i, v in enumerate(obj):
            found += unknown_fields(v, schema["items"], f"{path}[{i}]")
    return found


RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}


def _containers(pod: dict) -> list:
    return [*pod.get("initContainers", []), *pod.get("containers", []),
            *pod.get("ephemeralContainers", [])]


def restricted_problems(pod: dict) -> list:
    """What in a pod spec the "restricted" Pod Security Standard refuses (empty: admitted)."""
    problems = []
    psc = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            problems.append(f"{key} is true")
    for v in pod.get("volumes") or []:
        kind = next(k for k in v if k != "name")
        if kind not in RESTRICTED_VOLUMES:
            problems.append(f"volume {v['name']} is a {kind}")
    for s in psc.get("sysctls") or []:
        if s["name"] not in SAFE_SYSCTLS:
            problems.append(f"sysctl {s['name']}")
    for c in _containers(pod):
        sc, name = c.get("securityContext") or {}, c["name"]
        if sc.get("privileged"):
            problems.append(f"{name} is privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name} does not set allowPrivilegeEscalation: false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{name} does not drop ALL capabilities")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name} adds capabilities {caps['add']}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            problems.append(f"{name} uses a hostPort")
        if sc.get("procMount", "Default") != "Default":
            problems.append(f"{name} procMount {sc['procMount']}")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            problems.append(f"{name} may run as root (runAsNonRoot not true)")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            problems.append(f"{name} runs as uid 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name} has seccomp profile {seccomp}")
    return problems


def crd_schema(*parts) -> dict:
    """The openAPIV3Schema of a CRD in ../shared/reference (skips where it is absent)."""
    return reference_yaml(*parts)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def job_pods(job) -> list:
    """The pod specs of a rendered PyTorchJob, or of the patched TrainJob pod."""
    if job["kind"] == "PyTorchJob":
        return [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    spec = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    return [spec["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]]
