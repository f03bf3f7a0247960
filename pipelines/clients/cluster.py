"""What every cluster command shares, said once: its flags (`ClusterOptions`), the verbs of every
client of a kind of object on the cluster (`ClusterClient`), and the one body of "submit, then
maybe wait" (`submit_and_wait`).

The verbs are the ones kubeflow/sdk has every trainer backend implement
(`kubeflow/trainer/backends/base.py`: an abstract class, one method per verb): submit (create,
or re-attach to the object of that name), wait, delete, and logs where the kind runs pods whose
log is ours to show. The clients of jobs (pipelines/jobs/jobclient.py), InferenceServices
(pipelines/serve/deployclient.py) and Katib Experiments (pipelines/tune/experimentclient.py)
implement them over pipelines/clients/k8s.py's `Api`, which maps every failure once.

What a timeout does is the kind's to say (`deletes_on_timeout`), not a default of its own: a job
is deleted, its GPUs freed, unless `--keep-on-timeout`; an Experiment or an InferenceService is
left as it is, and the error says how to remove it.
"""

import abc
from dataclasses import dataclass

from kfvision.pipelines.clients.k8s import Api, WaitTimeoutError
from kfvision.trainer.options import check_options, option, options_of


def namespace_option(unset: str):
    """The namespace flag, `-n/--namespace`, of every command that names one: the cluster commands
    (ClusterOptions) and the renderers whose manifests carry it (JobConfig, DeployConfig)."""
    return option(None, "namespace", short="-n", unset=unset)


@dataclass(frozen=True)
class ClusterOptions:
    """The flags of the commands that talk to a cluster, each declared once with one default
    (pipelines/cli/clusterargs.py adds them: -n to every such command, the rest to those that
    submit)."""

    namespace: str | None = namespace_option("the manifest's, if any, else the current context's")
    wait: bool = option(False, "wait until it has finished (or is Ready), saying how it went")
    timeout: float | None = option(
        None, "stop waiting after this many seconds", low=0, low_open=True, metavar="SECONDS",
        unset="no limit", doc="Waiting past it exits 124. A job is then deleted unless "
        "--keep-on-timeout; an Experiment or an InferenceService is left as it is.")
    poll: float = option(5.0, "seconds between status checks", low=0, low_open=True,
                         metavar="SECONDS", doc="Each check reads the object (and, for a job, "
                         "lists its pods until the log of rank 0 streams).")
    keep_on_timeout: bool = option(False, "leave it on the cluster when --timeout passes",
                                   doc="Only where a timeout deletes what was submitted: jobs.")

    def validate(self) -> "ClusterOptions":
        check_options(self)
        return self


CLUSTER_OPTIONS = options_of(ClusterOptions)
POLL_S = ClusterOptions.poll  # the declared default, for callers that are not a command line


class ClusterClient(abc.ABC):
    """The verbs every client of a kind of cluster object implements, over `api` (one
    namespace). A subclass says how messages name its kind (`what`), which `kfvision` command
    group handles it (`command`, for the commands a message suggests) and what a timeout does
    (`deletes_on_timeout`)."""

    what: str = "object"
    command: str = ""
    deletes_on_timeout: bool = False

    def __init__(self, api: Api):
        self.api, self.namespace = api, api.namespace

    def say(self, line: str) -> None:
        self.api.say(line)

    def where(self, name: str) -> str:
        return f"{self.what} {self.namespace}/{name}"

    @abc.abstractmethod
    def submit(self, obj: dict) -> dict:
        """Create `obj`, or re-attach to the one of its name (a retried command or step never
        makes a second), saying which; the object as the cluster has it."""

    @abc.abstractmethod
    def wait(self, name: str, timeout_s: float | None = None, poll_s: float = POLL_S) -> dict:
        """Poll every `poll_s` s until it has finished well (returned) or badly (a named error,
        e.g. JobFailedError); WaitTimeoutError once `timeout_s` (None: no limit) has passed."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Delete it; owner references take what it made (pods, trials) along."""


class LogsClient(ClusterClient):
    """A ClusterClient of a kind whose pods run our code, so their log is ours to show."""

    @abc.abstractmethod
    def logs(self, name: str, replica: str | None = None, *, tail: int | None = None,
             previous: bool = False) -> str:
        """The log of one of its pods (`replica`; None: rank 0's)."""


def submit_and_wait(client: ClusterClient, obj: dict, *, config_maps=(), wait: bool = False,
                    timeout_s: float | None = None, poll_s: float = POLL_S,
                    keep_on_timeout: bool = False, **wait_kw) -> dict:
    """Create the ConfigMaps a user's script's pods mount (`config_maps`, reused when there),
    then `obj` (or re-attach to it), and with `wait` wait for it (`wait_kw`: the kind's own
    options, e.g. a job's `logs`).

    On a timeout a kind that `deletes_on_timeout` is deleted unless `keep_on_timeout`.
    Returns:
        the object (final, when waiting).
    Raises:
        WaitTimeoutError (or its subclass the kind raises), what `client.wait` raises when it
        ended badly, KubernetesError, EndpointError.
    """
    for cm in config_maps:
        _, created = client.api.create_config_map(cm)
        client.say(f"{'created' if created else 'reusing'} ConfigMap {client.namespace}/"
                   f"{cm['metadata']['name']}")
    current = client.submit(obj)
    if not wait:
        return current
    name = obj["metadata"]["name"]
    try:
        return client.wait(name, timeout_s, poll_s, **wait_kw)
    except WaitTimeoutError as e:
        if not client.deletes_on_timeout:
            raise
        if keep_on_timeout:
            raise type(e)(f"{e}\nIt is still there (--keep-on-timeout): kfvision "
                          f"{client.command} delete {name} -n {client.namespace}") from e
        client.delete(name)
        raise type(e)(f"{e}\nDeleted it (pass --keep-on-timeout to keep it).") from e
