"""What a job wrote, as a version in a model registry: `kfvision register --model PATH` of a file or
folder that is not a model directory kfvision serves (a `torch.save` pickle, a state_dict, a
checkpoint), and Azure's `run.register_model` in a job (pipelines/script/azurerun.py).

Such a version is marked not servable (tag `kfvision.servable=false`) and names the job it came
from (`kfvision.job_name`): `--job NAME`, else the provenance the file carries: the record
`kfvision job download` writes beside what it downloaded (JOB_RECORD), or the model folder's
kfvision-source.json (pipelines/contract.py PROVENANCE) that node 0's boot wrote. The message
says what `serve` and `deploy` need, and how to make it.
"""

import json
import os
from pathlib import Path

from kfvision.pipelines import contract
from kfvision.trainer.errors import InvalidModelDirectoryError

# written by `kfvision job download` into the folder it downloads into: {file or folder name:
# {"job": NAME, "path": "model/model.pt", "kind": "PyTorchJob"|"local run"}}
JOB_RECORD = ".kfvision-job.json"
SERVABLE_TAG, JOB_TAG = "kfvision.servable", "kfvision.job_name"
ARTIFACTS = "registered"  # where in a running job's MLflow run its registered files go


def record_download(out_folder: Path, target: Path, *, job: str, path: str, where: str) -> None:
    """Remember in `out_folder`/JOB_RECORD that `target` came from job `job`'s `path`."""
    record_file = Path(out_folder) / JOB_RECORD
    try:
        record = json.loads(record_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = {}
    record = record if isinstance(record, dict) else {}
    record[Path(target).name] = {"job": job, "path": path, "from": where}
    record_file.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def job_of(path: Path) -> str | None:
    """The job a downloaded file or folder came from, as its provenance says (None: unknown)."""
    path = Path(path)
    try:
        record = json.loads((path.parent / JOB_RECORD).read_text(encoding="utf-8"))
        entry = record.get(path.name) if isinstance(record, dict) else None
        if isinstance(entry, dict) and entry.get("job"):
            return str(entry["job"])
    except (OSError, ValueError):
        pass
    made = contract.read_provenance(path) if path.is_dir() else {}
    return made.get("job")


def what_it_is(path: Path) -> tuple:
    """(about, servable): registry.describe_model's record of a model directory kfvision serves,
    else a record of a file or folder that only carries bytes (classes unknown)."""
    from kfvision.pipelines.clients import registry

    path = Path(path)
    if not path.exists():
        raise InvalidModelDirectoryError(f"{path} does not exist: give a model directory, or a "
                                         "file or folder a job wrote (`kfvision job download "
                                         "NAME model/...`).")
    why = "a file, not a model directory"
    if path.is_dir():
        try:
            return registry.describe_model(path), True
        except InvalidModelDirectoryError as e:
            why = str(e).splitlines()[0].rstrip(". :")
    kind = "folder" if path.is_dir() else "file"
    return {"classes": None, "image_size": None, "format_version": "1", "metrics": {},
            "artifact": kind, "why": why}, False


def serve_needs(path: Path) -> str:
    """What serve and deploy need of a version, and what makes it."""
    return (f"{path.name} is not a model directory kfvision serves, so `kfvision serve` and "
            "`deploy` refuse this version: they need a folder with the network as TorchScript "
            "(model.pt), torch.export (model.pt2) or ONNX (model.onnx) and classes.txt "
            "(docs/scripts.md, \"What your script writes so kfvision can score, serve and "
            "deploy it\"). A state_dict or a pickled module needs the script's code to become "
            "one: load it there and save it in one of those formats, then `kfvision register` "
            "that folder. A torchvision architecture's state_dict also starts a model: "
            "`kfvision model ARCH DIR --weights FILE`, then `kfvision train`")


def register(path, name: str, *, job: str | None = None, registry_kind: str = "mlflow",
             description: str = "", tracking_uri: str | None = None, run_id: str | None = None,
             tags: dict | None = None, artifact_path: str = "model", **kubeflow) -> dict:
    """Register `path` (any file or folder a job wrote) in `registry_kind`: servable model
    directories as registry.register_mlflow/register_kubeflow do, anything else as a version
    marked not servable; both name `job` (else the provenance's). Returns the registry's record
    with "servable" and "job"."""
    from kfvision.pipelines.clients import registry

    path = Path(path)
    about, servable = what_it_is(path)
    job = job or job_of(path)
    extra = {**(tags or {}), **({JOB_TAG: job} if job else {})}
    if not servable:
        extra[SERVABLE_TAG] = "false"
        description = description or f"not servable: a {about['artifact']} a job wrote"
    if registry_kind == "mlflow":
        got = registry.register_mlflow(path, name, description=description,
                                       tracking_uri=tracking_uri, run_id=run_id,
                                       about=None if servable else about, tags=extra,
                                       artifact_path=artifact_path)
    else:
        got = registry.register_kubeflow(path, name, description=description,
                                         about=None if servable else about, tags=extra,
                                         **kubeflow)
    return {**got, "servable": servable, "job": job, "why": about.get("why")}


def register_from_job(path, name: str, *, job: str | None, description: str = "",
                      run_id: str | None = None, tags: dict | None = None) -> dict:
    """Azure's `run.register_model` in a running job: `path` registered in the job's MLflow
    (MLFLOW_TRACKING_URI) under its run; without a server, the message says the command to run
    after the job. Returns {"version", "uri", "message"}."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or uri.startswith("file:"):
        later = (f"kfvision job download {job or 'JOB'} outputs/{Path(path).name} && "
                 f"kfvision register --model {Path(path).name} --name {name}")
        return {"version": None, "uri": None,
                "message": f"register_model({name}): this job has no MLflow server "
                           f"(--tracking-uri), so nothing was registered; after the job: {later}"}
    got = register(path, name, job=job, description=description, tracking_uri=uri,
                   run_id=run_id, tags=tags, artifact_path=f"{ARTIFACTS}/{name}")
    state = "registered" if got["created"] else "already registered (same content)"
    where = f"models:/{got['name']}/{got['version']}"
    note = "" if got["servable"] else f" (not servable: {got['why']}. {serve_needs(Path(path))})"
    return {"version": got["version"], "uri": where,
            "message": f"register_model: {state}: {name} version {got['version']} from job "
                       f"{job or '(unnamed)'} as {where}{note}"}
