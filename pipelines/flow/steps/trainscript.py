"""The train step with your own script (pipeline parameter script_source, docs/scripts.md "In the
pipeline"): the job `kfvision job render --source` renders
(kfvision.pipelines.script.manifest), run as `kfvision job run-local` runs it, or submitted and
waited for as the built-in train step submits its job (kfvision.pipelines.flow.steps.train); the
model folder the script wrote becomes the step's Model.

Everything the job reads or writes lives in a stage folder: a temporary folder of this step when
it runs locally; on a cluster `<the run's data place>/jobs/<job>/`
(kfvision.pipelines.flow.storage), which the job's pods mount at the same path, as the built-in
trainer's staged inputs.

- `source/<sha256>.tar.gz`: the snapshot, packed here from a folder or downloaded here from an
  s3:// URI (with this step's credentials), read by the boot as from a PVC (`--source-pvc`): the
  pods need no object-store credentials, and no ConfigMap is created (the pipeline's Role has
  no verbs on configmaps).
- `channels/train`, `channels/validation`: the pipeline's converted images as data channels
  (KFVISION_INPUT_TRAIN, SM_CHANNEL_TRAIN, ...): class folders of symbolic links to the images
  of each side of the split, so torchvision's ImageFolder reads exactly that side. No image is
  copied.
- `result/`: `--output-uri`, where node 0 copies the model and outputs folders after success;
  `result/model` is copied into the step's Model output.
"""

import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kfvision.pipelines.clients.k8s import to_yaml
from kfvision.pipelines.clients.s3 import is_s3
from kfvision.pipelines.flow.steps.common import resolve_mode
from kfvision.pipelines.flow.steps.train import (
    JOB_PREFIX,
    STAGED_MARK,
    cluster_client,
    job_config,
    job_kinds,
    job_volumes,
    replace_failed_job,
    staging_folder,
)
from kfvision.pipelines.jobs.config import job_name
from kfvision.pipelines.jobs.mlflowenv import tracking_env
from kfvision.pipelines.script.entry import resolve
from kfvision.pipelines.script.manifest import (
    NO_TRAINER,
    ScriptConfig,
    build_script_job,
    choose_transport,
)
from kfvision.pipelines.script.snapshot import InvalidSourceError, Snapshot, pack
from kfvision.trainer.errors import InvalidModelDirectoryError, InvalidParameterError, ref
from kfvision.trainer.fileio import disk_errors

CHANNELS = ("train", "validation")  # the data channels' names, in the order the step takes them
# How the pipeline names a script setting in an error (kfvision.pipelines.script.entry.resolve): as
# its parameter in a step's log (script_entry), as its flag on the command line (--script-entry)
PARAMETERS = {"source": ref("script_source"), "entry": ref("script_entry"),
              "module": ref("script_entry") + " -m", "requirements": ref("script_requirements"),
              "workdir": "workdir"}


def parse_entry(text: str) -> dict:
    """{"entry", "module"} of script_entry: `train.py`, or `-m pkg.module`."""
    text = text.strip()
    if text.startswith("-m"):
        module = text[2:].strip()
        if module and not any(c.isspace() for c in module):
            return {"entry": None, "module": module}
    elif text:
        return {"entry": text, "module": None}
    raise InvalidParameterError(f"{ref('script_entry')} = {text!r} is not a script: give the "
                                "file to run, relative to script_source (train.py), or -m "
                                "pkg.module.")


def parse_args(text: str) -> tuple:
    """script_args as the script's argv: split as a POSIX shell would (shlex.split)."""
    try:
        return tuple(shlex.split(text))
    except ValueError as e:
        raise InvalidParameterError(f"{ref('script_args')} = {text!r} cannot be split as a "
                                    f"shell would ({e}): close its quotes.") from e


def script_config(script: dict, snap: Snapshot, stage: Path) -> ScriptConfig:
    """The ScriptConfig of the pipeline's script parameters (params.script_settings), its entry
    checked against the snapshot; channels and results in `stage`.

    Raises:
        InvalidParameterError: a malformed script_entry or script_args.
        InvalidJobError: the entry or requirements file is not in the snapshot.
    """
    start = resolve(snap.files, source=script["script_source"],
                    requirements=script["script_requirements"] or None, name=PARAMETERS,
                    **parse_entry(script["script_entry"]))
    return ScriptConfig(source=script["script_source"], **start,
                        args=parse_args(script["script_args"]),
                        launcher=script["script_launcher"],
                        inputs=tuple((c, str(stage / "channels" / c)) for c in CHANNELS),
                        output_uri=str(stage / "result"))


def snapshot(source: str, scratch: Path) -> Snapshot:
    """The packed source: a folder packed here, or an s3:// .tar.gz downloaded (into `scratch`).

    Raises:
        InvalidSourceError: not a folder, not there, or not a gzip'd tar archive.
    """
    if not is_s3(source):
        if not Path(source).is_dir():
            raise InvalidSourceError(f"script_source {source} is not a folder this "
                                     "step can read, nor an s3:// URI of a packed source.")
        return pack(source)
    import tarfile

    from kfvision.pipelines.clients import s3, s3download

    obj = s3.head(source)
    if obj is None:
        raise InvalidSourceError(f"script_source {source} is not there; upload the "
                                 "packed source (kfvision job render --source DIR "
                                 "--source-store s3://BUCKET/PREFIX does).")
    target = scratch / "download.tar.gz"
    s3download.download(obj, s3.split_uri(source)[0], target)
    data = target.read_bytes()
    target.unlink()
    sha256 = hashlib.sha256(data).hexdigest()
    named = Path(source).name.removesuffix(".tar.gz")
    if len(named) == 64 and named != sha256 and all(c in "0123456789abcdef" for c in named):
        raise InvalidSourceError(f"{source} has sha256 {sha256}, not the one its name says: it "
                                 "changed after it was uploaded; upload it again.")
    try:
        import io

        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            files = tuple(m.name for m in tar.getmembers() if m.isfile())
    except (tarfile.TarError, OSError, EOFError) as e:
        raise InvalidSourceError(f"{source} is not a .tar.gz of a source folder ({e}); pack one "
                                 "with kfvision job render --source DIR --source-store ...") from e
    return Snapshot(data, sha256, files)


def channel(image_directory, dest: Path) -> int:
    """Class folders of links to the images of `image_directory` at `dest` (what ImageFolder
    reads); the number of images."""
    from kfvision.trainer.data.imagedir import read_image_directory

    imdir = read_image_directory(image_directory).require_labelled("a script's data channel")
    for e in imdir.images:
        name = imdir.classes[e.label]
        link = dest / (e.path if e.path.startswith(f"{name}/") else f"{name}/{e.path}")
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(imdir.file(e).resolve())
    return len(imdir.images)


def stage_script(stage: Path, snap: Snapshot, transport, train_dir, val_dir) -> None:
    """Write the snapshot and the channels into `stage`, once (a retried step finds them)."""
    if (stage / STAGED_MARK).exists():
        return
    shutil.rmtree(stage, ignore_errors=True)
    with disk_errors(stage):
        Path(transport.where).parent.mkdir(parents=True)
        Path(transport.where).write_bytes(snap.data)
        for name, data in zip(CHANNELS, (train_dir, val_dir), strict=True):
            channel(data, stage / "channels" / name)
        (stage / STAGED_MARK).write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"), encoding="utf-8")


def write_job(docs: list, job_yaml, script: ScriptConfig) -> None:
    """The rendered job (the step's job artifact)."""
    header = ("Rendered by kfvision's train-pytorch-model step from your script "
              f"({script.target} {shlex.join(script.args)}".rstrip() + "); `kubectl apply -f` "
              "runs it again while its stage folder is there.")
    text = to_yaml(docs[0], header) + "".join("---\n" + to_yaml(d) for d in docs[1:])
    Path(job_yaml).parent.mkdir(parents=True, exist_ok=True)
    Path(job_yaml).write_text(text, encoding="utf-8")


def script_train_step(train_dir, val_dir, out_dir, job_yaml, *, script: dict, settings: dict,
                      run_key: str, mode: str = "auto", pvc_name: str = "", kind: str = "auto",
                      runtime: str = "torch-distributed", workspace: str = "",
                      out=None) -> dict:
    """Train with the user's script as a TrainJob or PyTorchJob; its model folder at `out_dir`.

    Args as kfvision.pipelines.flow.steps.train.train_step's, less the untrained model and the
    training options; script: the script parameters (params.script_settings).
    Returns:
        {"script": entry, args, launcher, source_sha256; "final": the numbers of the model
        folder's metrics.json "final", if any; "layout": "ok" or why kfvision cannot score it}.
    Raises:
        InvalidParameterError, InvalidJobError, InvalidSourceError: bad script parameters or an
            entry that is not in the source. JobFailedError: the script failed.
        InvalidModelDirectoryError: it succeeded but wrote nothing into its model folder.
    """
    out = out or sys.stdout
    mode = resolve_mode(mode)
    kinds = job_kinds(kind, mode)
    run_id = run_key.partition("/")[0]
    name = job_name(JOB_PREFIX, run_key)
    if mode == "cluster":
        stage = staging_folder(workspace, run_id) / name
        client, job_kind = cluster_client(kinds, out)
        volumes = job_volumes(client, workspace, pvc_name, settings["nodes"])
    else:
        (job_kind,), client, volumes = kinds, None, ()
        stage = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    try:
        with tempfile.TemporaryDirectory(prefix="kfvision-source-") as scratch:
            snap = snapshot(script["script_source"], Path(scratch))
        config = script_config(script, snap, stage)
        transport = choose_transport(snap, None, str(stage / "source"))
        env = tracking_env(os.environ, kind=job_kind.kind, name=name, run_id=run_id,
                           local=client is None, out=out)
        job = job_config(NO_TRAINER, run_id=run_key, volumes=volumes, env=env, **settings)
        docs = build_script_job(job, config, snap, transport, kind=job_kind,
                                runtime=runtime)
        stage_script(stage, snap, transport, train_dir, val_dir)
        write_job(docs, job_yaml, config)
        print(f"{job_kind.kind} {name} runs your script {config.target} (source sha256 "
              f"{snap.sha256[:12]}, {len(snap.files)} file(s))", file=out, flush=True)
        if client is None:
            _run_here(docs[-1], job_kind, stage, name, out)
        else:
            replace_failed_job(client, name, stage / "result")
            from kfvision.pipelines.jobs.jobclient import submit

            submit(client, docs[-1], wait=True, poll_s=10.0, logs=True)
        summary = keep_model(stage / "result" / "model", out_dir, config, snap, out)
    finally:
        if client is None:  # a local stage goes with the step; a cluster's once the model is out
            shutil.rmtree(stage, ignore_errors=True)
    shutil.rmtree(stage, ignore_errors=True)
    return summary


def _run_here(job: dict, job_kind, stage: Path, name: str, out) -> None:
    from kfvision.pipelines.jobs.render import run_local

    print(f"running {job_kind.kind} {name} on this machine (kfvision job run-local)", file=out,
          flush=True)
    result = run_local(job, stage / "logs", source=f"{job_kind.kind} {name}", out=out)
    print(f"{job_kind.kind} {name} succeeded in {result.seconds:.1f} s", file=out, flush=True)


def keep_model(model: Path, out_dir, script: ScriptConfig, snap: Snapshot, out) -> dict:
    """Copy the script's model folder into the step's Model output and say what it holds."""
    if not model.is_dir() or not any(model.iterdir()):
        raise InvalidModelDirectoryError(
            f"your script {script.target} succeeded but wrote nothing into its model folder "
            "(KFVISION_MODEL_DIR, SM_MODEL_DIR, AIP_MODEL_DIR), so the pipeline has no model to "
            "score: save the network there as model.pt2, model.pt or model.onnx with "
            "classes.txt (docs/scripts.md).")
    with disk_errors(out_dir):
        shutil.copytree(model, out_dir, dirs_exist_ok=True)
    layout = model_layout(out_dir)
    if layout != "ok":
        print(f"warning: the model folder your script wrote cannot be scored: {layout}; "
              "score-image-model will fail saying so (docs/scripts.md)", file=out, flush=True)
    return {"script": {"entry": script.target, "args": list(script.args),
                       "launcher": script.launcher, "source_sha256": snap.sha256},
            "final": final_figures(out_dir), "layout": layout}


def model_layout(model_dir) -> str:
    """"ok" when kfvision can score `model_dir` (a trained model directory, or a script's
    network and class names), else the first line of why not."""
    from kfvision.trainer.model.layout import model_kind

    try:
        model_kind(model_dir)
    except InvalidModelDirectoryError as e:
        return str(e).splitlines()[0]
    return "ok"


def final_figures(model_dir) -> dict:
    """The numbers of the model folder's optional metrics.json "final" ({} when none)."""
    try:
        final = json.loads((Path(model_dir) / "metrics.json").read_text()).get("final", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: v for k, v in (final if isinstance(final, dict) else {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}

