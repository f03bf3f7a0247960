"""Where a run's data lives on a cluster: the run's KFP workspace, a data PVC, both, or object
storage alone.

The dataset crosses storage once. A source folder on a PVC is referenced where it is (the image
directories the steps pass on hold manifests, not images: kfvision.trainer.data.imagedir); an
archive or an http(s) download is extracted once, into the run's *data place*; the job reads the
images at the paths the steps saw them at, and only the trained model is copied into the artifact
store.

    the data place                         when
    <workspace>/kfvision/...               the pipeline has a KFP workspace (KFP 2.15+; default):
                                           a PVC KFP makes for each run, mounted at
                                           /kfp-workspace in the tasks that ask for it
    /kfvision-data/kfvision-runs/<run>/... no workspace (--workspace-size ''): the data PVC
    (none: the image directory's folder)   a local run (no cluster): the convert step's output

With a store (`--data-uri s3://BUCKET/PREFIX`) no volume is shared at all: the convert and split
steps push the image directories to `PREFIX/<run>/<folder>` (`run_prefix`), the train step pushes
the untrained model there and runs a job whose --train/--val/--model/--out are those URIs (its
pods run the node agent, pipelines/jobs/storenode.py, and mount no PVC), and score, register and
deploy read from there. A step's own disk only holds what it works on, for as long as it does.

Which of these a pipeline uses is fixed when it is compiled (`Storage`, the flags of `kfvision
pipeline compile`): KFP mounts volumes by the compiled spec, and a PVC whose name is empty at run
time fails the task ("missing mountpath or pvc name"). The run parameter `pvc_name` names the
data PVC of a pipeline compiled with one.
"""

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kfvision.pipelines.clients.s3 import is_s3, split_uri
from kfvision.trainer.errors import InvalidParameterError, OutputError
from kfvision.trainer.options import check_options, option

WORKSPACE_MOUNT = "/kfp-workspace"  # kfp.dsl.constants.WORKSPACE_MOUNT_PATH (and the backend's)
DATA_MOUNT = "/kfvision-data"  # where the data PVC is mounted, in the steps and the job's pods
OUR_FOLDER = "kfvision"  # ours inside the workspace
RUNS_FOLDER = "kfvision-runs"  # ours on the data PVC, one folder per run
ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce")
USER = 1000  # uid and gid of the image's user: the steps' and the job pods'


@dataclass(frozen=True)
class Storage:
    """Compile-time storage of the pipeline (see the module doc)."""

    workspace_size: str = option(
        "50Gi", "size of the run's KFP workspace ('': none)", doc="A PVC that KFP 2.15+ makes "
        "for each run and deletes when the run succeeds: it holds extracted archives and "
        "downloads, and the job's model until the train step has copied it out. '' for KFP "
        "before 2.15: then --data-pvc is needed.")
    workspace_class: str = option(
        "", "storage class of the workspace ('': the cluster's default class)")
    workspace_access: str = option(
        "ReadWriteMany", "access mode of the workspace", doc="ReadWriteMany lets the steps and "
        "every node of the job mount it wherever they run; ReadWriteOnce only works when all of "
        "them land on one node (a one-node cluster, a one-node job).", choices=ACCESS_MODES)
    data_pvc: str = option(
        "", "a PVC that already holds your data ('': none)", doc="Mounted at /kfvision-data in "
        "the steps that read data and in the job's pods (sources are then paths there, "
        "referenced in place); the default of the run parameter pvc_name. Without it, sources "
        "are http(s) URLs.", metavar="NAME")

    s3_credentials: str = option(
        "", "a Secret of AWS_* variables for the steps using s3:// ('': none)", doc="Its keys "
        "are the standard AWS variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3, AWS_REGION, "
        "AWS_DEFAULT_REGION), given as environment to exactly the steps that talk to s3:// "
        "(convert, train; with --data-uri also split and score, and the job's pods): the "
        "default of the run parameter s3_secret. Without it, IRSA or a node role still work.",
        metavar="NAME")
    data_uri: str = option(
        "", "s3://BUCKET/PREFIX the steps and the job pass everything through ('': none)",
        doc="No shared volume at all: the image directories, the untrained and the trained "
        "model go to PREFIX/<run id>/ (source, train, val, test, untrained, model), the job "
        "reads and "
        "writes them there (its pods fetch onto their own scratch disk; any number of nodes), "
        "and score and deploy read from there. Valid with --workspace-size '' and no "
        "--data-pvc.", metavar="URI")

    @property
    def workspace(self) -> bool:
        return bool(self.workspace_size)

    def validate(self) -> "Storage":
        """For a cluster: a place for the run's data (workspace, data PVC or store) and valid
        values."""
        check_options(self)
        if self.data_uri:
            check_store_uri(self.data_uri)
        elif not self.workspace and not self.data_pvc:
            raise InvalidParameterError(
                "--workspace-size '' (no workspace) needs --data-pvc NAME or --data-uri "
                "s3://BUCKET/PREFIX: without a KFP workspace, the run's extracted data and the "
                "job's model go on the data PVC, or through object storage.")
        if self.workspace:
            from kfp.dsl import WorkspaceConfig

            try:
                WorkspaceConfig(size=self.workspace_size)
            except ValueError as e:
                raise InvalidParameterError(f"--workspace-size {self.workspace_size!r}: {e}") from e
        return self

    def check_arguments(self, params: dict) -> None:
        """What a run of the pipeline compiled with this storage cannot do (checked before
        submitting; the check step does the same from its mounts)."""
        check_data_pvc_use(params, bool(self.data_pvc), has_store=bool(self.data_uri))
        if params.get("s3_secret") and not self.s3_credentials:
            raise InvalidParameterError(
                f"s3_secret = {params['s3_secret']!r}, but the pipeline is compiled without an "
                f"S3 Secret: add --s3-credentials {params['s3_secret']} (`kfvision pipeline "
                "compile` or `submit`).")

    def pipeline_config(self):
        """The kfp.dsl.PipelineConfig that asks KFP for the workspace (None without one)."""
        from kfp import dsl

        if not self.workspace:
            return None
        patch = {"accessModes": [self.workspace_access]}
        if self.workspace_class:
            patch["storageClassName"] = self.workspace_class
        return dsl.PipelineConfig(workspace=dsl.WorkspaceConfig(
            size=self.workspace_size, kubernetes=dsl.KubernetesWorkspaceConfig(pvcSpecPatch=patch)))


def check_data_pvc_use(params: dict, has_data_pvc: bool, *, has_store: bool = False) -> None:
    """Without a data PVC a run cannot read a path source, mount `pvc_name` or deploy (KServe
    serves the model from the data PVC) unless the model is in object storage (model_uri, or
    the store a pipeline compiled with --data-uri passes everything through)."""
    if has_store and params.get("script_source"):
        raise InvalidParameterError(
            "script_source with a pipeline compiled with --data-uri: your script's job reads "
            "its channels from a volume, which such a pipeline does not have. Compile without "
            "--data-uri (a workspace or --data-pvc), or use the built-in trainer.")
    if has_data_pvc:
        return
    import urllib.parse

    for name in ("train_source", "validation_source", "test_source"):
        source = params.get(name) or ""
        if source and urllib.parse.urlparse(source).scheme.lower() not in ("http", "https", "s3"):
            raise InvalidParameterError(
                f"{name} {source!r} is a path, but the pipeline is compiled without a data "
                "PVC, so no step could see it: give an http(s) URL or an s3:// URI, or add "
                "--data-pvc NAME "
                "(the PVC that holds it, mounted at /kfvision-data).")
    if params.get("pvc_name"):
        raise InvalidParameterError(
            f"pvc_name = {params['pvc_name']!r}, but the pipeline is compiled without a data "
            f"PVC: add --data-pvc {params['pvc_name']} (`kfvision pipeline compile` or "
            "`submit`).")
    if params.get("deploy") and not params.get("model_uri") and not has_store:
        raise InvalidParameterError(
            "deploy on a cluster copies the model onto the data PVC for KServe to serve: add "
            "--data-pvc NAME (`kfvision pipeline compile` or `submit`), or give model_uri "
            "(s3://...) for KServe to fetch it from.")


DEFAULT = Storage()  # what `kfvision pipeline compile` makes without storage flags
LOCAL = Storage(workspace_size="", data_pvc="")  # a local run: neither (not validated)


def check_store_uri(uri: str) -> str:
    """`uri`, an s3:// prefix with a bucket (--data-uri)."""
    if not is_s3(uri):
        raise InvalidParameterError(f"--data-uri {uri!r} is not an s3:// URI: give "
                                    "s3://BUCKET/PREFIX (or '' for none).")
    split_uri(uri)
    return uri


def run_prefix(store: str, run_id: str, folder: str) -> str:
    """`store`/<run>/<folder>/: where a run puts one of its image directories or models in the
    store (a retried step writes to the same place; another run never does)."""
    return f"{store.rstrip('/')}/{safe_name(run_id)}/{folder}/"


def is_mount(path) -> bool:
    """Whether a PVC is mounted at `path` (a PVC is a mount point; a folder of the image is
    not)."""
    return os.path.ismount(path)


def data_place(workspace: str, run_id: str, *, cluster: bool, mounted=is_mount,
               data_mount: str = DATA_MOUNT) -> Path | None:
    """The folder for the run's own data (extracted sources, the job's staging): in the
    workspace when the task has one, else on the data PVC (cluster), else None (local)."""
    if workspace:
        return Path(workspace) / OUR_FOLDER
    if cluster and mounted(data_mount):
        return Path(data_mount) / RUNS_FOLDER / safe_name(run_id)
    return None


def safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text) or "run"


def new_folder(place: Path, prefix: str) -> Path:
    """A new, uniquely named folder in `place` (a retried step never meets an earlier attempt's)."""
    place.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=place))


def prepare_workspace(workspace: str) -> str:
    """Make <workspace>/kfvision writable by the steps and the job's pods (uid 1000): KFP gives
    its pods no fsGroup, so a new volume's root may be writable by root only. The step runs as
    root, once per run, before the steps that write there; KFP drops every capability, so it
    cannot chown: it makes the folder (root's) and opens it to every user (mode 0777; the
    volume belongs to this run alone). Returns what it did."""
    if not workspace:
        return "no workspace: nothing to prepare"
    ours = Path(workspace) / OUR_FOLDER
    ours.mkdir(exist_ok=True)
    if stat.S_IMODE(ours.stat().st_mode) & 0o777 == 0o777:
        return f"{ours} is writable by every user already"
    try:
        os.chmod(ours, 0o777)
    except PermissionError as e:
        if os.access(ours, os.W_OK | os.X_OK) and os.geteuid() == USER:
            return f"{ours} is writable by uid {USER}"
        raise OutputError(
            f"{ours} cannot be opened to uid {USER} ({e.strerror}): the prepare-workspace step "
            "must run as root (or as the volume's owner). See docs/pipeline.md, 'Storage'."
        ) from e
    return f"{ours}: mode 0777 (the steps and the job's pods run as uid {USER})"
