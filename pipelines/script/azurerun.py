"""Azure ML v1's `Run` (azureml-core's `azureml.core.run.Run`), provided by kfvision in a job so
that a script written for Azure ML runs unchanged: `Run.get_context()` and the calls Azure's samples
make, with Azure's signatures (scripts pass arguments by keyword), onto kfvision's machinery.
The user's processes import it as `azureml.core` only when their environment has no azureml-core
(pipelines/script/bridges.py); kfvision's own processes never do.

- metrics (`log`, `log_list`, `log_row`): printed by rank 0 as the `name=value` lines (Katib's
  format) kfvision reads from every script, so they reach `kfvision job status`, the TrainJob's
  trainerStatus and the script's MLflow run (pipelines/script/progress.py), and Katib; a name is
  written with `_` for what that format does not take (`Training loss` -> `Training_loss`);
  values that are not finite numbers are left out;
- `log_table`, `log_image` and the `log_*` charts: files under the job's outputs
  (`outputs/azureml/`), which node 0's boot uploads as MLflow artifacts after the script;
- `tag`, `set_tags`, `add_properties`: tags of the script's MLflow run;
- `upload_file`, `upload_files`, `upload_folder`: copied into the job's outputs (`outputs/NAME`);
- `register_model`: the file or folder registered as `kfvision register` registers it (a version
  marked not servable unless it is a model directory kfvision serves, naming the job);
- `input_datasets[NAME]`: the local path of the job's data channel NAME (`--input NAME=URI`);
- `id`, `experiment` (`.name`, `.workspace`), `parent`, `get_status`, `complete`, `fail`:
  kfvision's values (Azure's offline run raises AttributeError for `experiment` and `parent`);
- the rest accepts the call and does nothing, as Azure's offline run does.
"""

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

from kfvision.pipelines import contract
from kfvision.trainer.tracking import JOB_NAME

OUT = "azureml"  # under the outputs folder: tables, images, charts
_NAME = re.compile(r"[^A-Za-z0-9_-]")  # what Katib's filter does not take in a name
PIPELINE_RUN = "KFVISION_PIPELINE_RUN"


def _rank() -> int:
    from kfvision.trainer.distributed import launcher_env

    return launcher_env()[0]


def _outputs() -> Path:
    return Path(os.environ.get(contract.OUTPUT_DIR) or "outputs")


def _number(value):
    if isinstance(value, bool):
        return int(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


class Workspace:
    """`run.experiment.workspace`: kfvision's (a job has no Azure workspace)."""

    def __init__(self, name: str):
        self.name = name
        self.subscription_id = self.resource_group = self.location = None

    def __repr__(self):
        return f"Workspace.create(name='{self.name}')"


class Experiment:
    """`run.experiment`: the MLflow experiment the job's run is in."""

    def __init__(self, workspace=None, name=None, **kwargs):
        self.name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "kfvision"
        self.workspace = workspace or Workspace("kfvision")

    def __repr__(self):
        return f"Experiment(Name: {self.name}, Workspace: {self.workspace.name})"


class Model:
    """What `register_model` returns: the version kfvision registered (version None when the job
    has no MLflow server)."""

    def __init__(self, name, version, tags=None, properties=None, description=None, url=None):
        self.name, self.version, self.description, self.url = name, version, description, url
        self.tags, self.properties = dict(tags or {}), dict(properties or {})
        self.id = f"{name}:{version}"

    def __repr__(self):
        return f"Model(name={self.name!r}, version={self.version!r})"


class _Channels(dict):
    def __missing__(self, key):
        raise KeyError(f"{key!r} is not a data channel of this job: it has "
                       f"{', '.join(sorted(self)) or 'none'}; give it with `--input {key}=URI`.")


class Run:
    """A kfvision job's process as Azure's `Run` (the module docstring says what each call
    does)."""

    def __init__(self, experiment=None, run_id=None, outputs=None, **kwargs):
        self.experiment = experiment or Experiment()
        self.id = run_id or os.environ.get("MLFLOW_RUN_ID") or os.environ.get(JOB_NAME) or "local"
        self.name = self.display_name = os.environ.get(JOB_NAME) or self.id
        self.number, self.type, self.status = 0, "kfvision", "Running"
        self._tags, self._properties, self._parent = {}, {}, kwargs.get("_parent")
        self._tracker = None

    @classmethod
    def get_context(cls, allow_offline=True, used_for_context_manager=False, **kwargs):
        """This process's run (the same object for every call)."""
        if not hasattr(cls, "_context"):
            cls._context = cls()
        return cls._context

    # --- what the run is -------------------------------------------------------------------
    @property
    def parent(self):
        """The job's pipeline run when it has one, else the job: logging into it logs into the
        same metrics."""
        if self._parent is None:
            self._parent = Run(self.experiment, os.environ.get(PIPELINE_RUN) or self.name,
                               _parent=self)
        return self._parent

    @property
    def input_datasets(self) -> dict:
        names = json.loads(os.environ.get(contract.SM_CHANNELS) or "[]")
        return _Channels({n: os.environ[contract.INPUT_PREFIX + contract.channel_key(n)]
                          for n in names
                          if contract.INPUT_PREFIX + contract.channel_key(n) in os.environ})

    @property
    def tags(self) -> dict:
        return dict(self._tags)

    @property
    def properties(self) -> dict:
        return dict(self._properties)

    def get_status(self) -> str:
        return self.status

    def get_details(self) -> dict:
        return {"runId": self.id, "status": self.status, "target": "kfvision",
                "properties": self.properties, "tags": self.tags}

    def get_tags(self) -> dict:
        return self.tags

    def get_properties(self) -> dict:
        return self.properties

    def complete(self, _set_status=True):
        self.status = "Completed"

    def fail(self, error_details=None, error_code=None, _set_status=True):
        self.status = "Failed"
        print(f"azureml run.fail: {error_code or ''} {error_details or ''}".rstrip(),
              file=sys.stderr, flush=True)

    def cancel(self):
        self.status = "Canceled"

    # --- metrics -----------------------------------------------------------------------------
    def _print(self, pairs: dict, step=None) -> None:
        """One `name=value` line on rank 0 (what kfvision reads as the script's metrics)."""
        if _rank() != 0:
            return
        numbers = {_NAME.sub("_", str(k)): _number(v) for k, v in pairs.items()}
        text = " ".join(f"{k}={v:.9g}" for k, v in numbers.items() if v is not None and k)
        if text:
            position = f"step={int(step)} " if _number(step) is not None else ""
            print(position + text, flush=True)

    def log(self, name, value, description="", step=None):
        self._print({name: value}, step)

    def log_list(self, name, value, description=""):
        for v in value:
            self._print({name: v})

    def log_row(self, name, description=None, **kwargs):
        self._print({f"{name}_{k}": v for k, v in kwargs.items()})

    def _write(self, kind: str, name, data) -> Path | None:
        if _rank() != 0:
            return None
        path = _outputs() / OUT / kind / f"{_NAME.sub('_', str(name))}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
        return path

    def log_table(self, name, value, description=""):
        self._write("tables", name, value)

    def log_accuracy_table(self, name, value, description=""):
        self._write("charts", name, value)

    log_confusion_matrix = log_predictions = log_residuals = log_accuracy_table

    def log_image(self, name, path=None, plot=None, description=""):
        if _rank() != 0:
            return
        target = _outputs() / OUT / "images" / f"{_NAME.sub('_', str(name))}.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        if plot is not None:  # a matplotlib.pyplot module or figure
            plot.savefig(target)
        elif path is not None:
            _copy(path, target.with_suffix(Path(str(path)).suffix or ".png")
                  if not hasattr(path, "read") else target)

    # --- tags and properties -------------------------------------------------------------------
    def _send_tags(self, tags: dict) -> None:
        if _rank() != 0:
            return
        if self._tracker is None:
            from kfvision.trainer.tracking import Tracker

            self._tracker = Tracker.from_env(None) or False
        if self._tracker:
            self._tracker.set_tags(tags)

    def tag(self, key, value=None):
        self.set_tags({key: "" if value is None else value})

    def set_tags(self, tags):
        tags = {str(k): ("" if v is None else str(v)) for k, v in dict(tags).items()}
        self._tags.update(tags)
        self._send_tags(tags)

    def add_properties(self, properties):
        properties = {str(k): str(v) for k, v in dict(properties).items()}
        self._properties.update(properties)
        self._send_tags(properties)

    # --- files ---------------------------------------------------------------------------------
    def upload_file(self, name, path_or_stream, datastore_name=None):
        """Copy a file (or a stream's bytes) into the outputs as NAME (`outputs/` in NAME is
        the outputs folder itself)."""
        target = _outputs() / _relative(name)
        _copy(path_or_stream, target)
        return str(target)

    def upload_files(self, names, paths, return_artifacts=False, timeout_seconds=None,
                     datastore_name=None):
        return [self.upload_file(n, p) for n, p in zip(names, paths, strict=True)]

    def upload_folder(self, name, path, datastore_name=None):
        target = _outputs() / _relative(name)
        if Path(path).resolve() != target.resolve():
            shutil.copytree(path, target, dirs_exist_ok=True)
        return str(target)

    def get_file_names(self) -> list:
        root = _outputs()
        return sorted(f"outputs/{p.relative_to(root).as_posix()}" for p in root.rglob("*")
                      if p.is_file())

    # --- models --------------------------------------------------------------------------------
    def register_model(self, model_name, model_path=None, tags=None, properties=None,
                       model_framework=None, model_framework_version=None, description=None,
                       datasets=None, sample_input_dataset=None, sample_output_dataset=None,
                       resource_configuration=None, **kwargs):
        """Register the file or folder at `model_path` (as Azure names it: `outputs/model.pt`,
        relative to the run's files; default: the outputs folder) as `kfvision register`
        does, naming the job; a Model."""
        path = _outputs() / _relative(model_path) if model_path else _outputs()
        if not path.exists() and model_path and Path(model_path).exists():
            path = Path(model_path)  # a path relative to the working folder, or absolute
        from kfvision.pipelines.script.jobmodel import register_from_job

        got = register_from_job(
            path, model_name, job=os.environ.get(JOB_NAME), description=description or "",
            run_id=os.environ.get("MLFLOW_RUN_ID"),
            tags={**{str(k): str(v) for k, v in (tags or {}).items()},
                  **({"azureml.model_framework": str(model_framework)} if model_framework
                     else {})})
        print(got["message"], file=sys.stderr, flush=True)
        return Model(model_name, got.get("version"), tags, properties, description,
                     got.get("uri"))

    # --- accepted and ignored, as Azure's offline run does -------------------------------------
    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _ignored


def _ignored(*args, **kwargs):
    return None


def _relative(name) -> Path:
    """Azure's artifact name as a path under the outputs folder."""
    parts = Path(str(name)).parts
    parts = parts[1:] if parts and parts[0] in ("outputs", "./outputs") else parts
    if not parts or ".." in parts or Path(str(name)).is_absolute():
        raise ValueError(f"{name!r}: give a name relative to the run's files, such as "
                         "outputs/model.pt")
    return Path(*parts)


def _copy(source, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if hasattr(source, "read"):
        data = source.read()
        target.write_bytes(data.encode() if isinstance(data, str) else data)
    elif Path(source).resolve() != target.resolve():
        shutil.copyfile(source, target)


__all__ = ["Run", "Experiment", "Workspace", "Model"]
