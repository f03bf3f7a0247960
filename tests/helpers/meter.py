"""The byte meter of docs/pipeline.md ("Data movement"): what a run of the pipeline writes, step by
step, per byte of the dataset.

What counts as moved, once per byte:
- an output artifact: on a cluster KFP uploads it to the artifact store; in a local run it is
  written under the run folder;
- an input artifact, on a cluster: KFP's launcher downloads it into the step's pod;
- a file a step (or the job it runs) creates on a volume (the data PVC, the KFP workspace),
  even when it deletes it again (the job's staging is looked at while the job runs);
- a download of an http(s) source, counted apart ("download"): a source that lives on the web
  has to cross the network once, so one download is allowed and not held against the steps.

Each file is counted under a kind: `images` (image files), `model` (the model directories:
untrained, trained, checkpoints), `download`, and `metadata` (manifests, the pictures the
steps draw, tables, pages, metrics, logs). "Moved per dataset byte" is everything but the model
and the download over the bytes of the source's images.

The cluster branch runs the steps' own functions (kfvision.pipelines.flow.steps,
kfvision.pipelines.flow.steps.train) in this process, as the KFP components call them, with
temporary folders standing in for the data PVC, the KFP workspace and each pod's local disk, KFP's
artifact passing done by copying, and a FAKE Kubernetes API (no API server can run here) whose
`submit` runs the rendered job as local processes with the platform's environment
(kfvision.pipelines.jobs.pytorchjob.local): the job really reads the images at the paths it was
given. What it cannot show: a real PVC's, CSI driver's or KFP launcher's own traffic.
"""

import inspect
import shutil
from collections import Counter
from pathlib import Path

from kfvision.trainer.data.imagedir import IMAGE_EXTENSIONS

KINDS = ("images", "metadata", "model", "download")
MODEL_PARTS = {"model", "trained_model", "trained", "checkpoints"}
ARCHIVES = (".zip", ".tar", ".gz", ".tgz", ".bz2")
DRAWN = {"samples.jpg", "confusion_matrix.png"}  # pictures the steps draw: metadata


def kind_of(path: Path) -> str:
    if MODEL_PARTS & set(path.parts) or path.suffix in (".pt", ".pth", ".onnx"):
        return "model"
    if path.suffix.lower() in IMAGE_EXTENSIONS and path.name not in DRAWN:
        return "images"
    if path.name.endswith(ARCHIVES):
        return "download"
    return "metadata"


def files(root) -> dict:
    """{path: (size, mtime_ns, inode)} of every file under `root` (none if it does not exist)."""
    root = Path(root)
    if root.is_file():
        st = root.stat()
        return {root: (st.st_size, st.st_mtime_ns, st.st_ino)}
    out = {}
    for p in root.rglob("*") if root.exists() else ():
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            out[p] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def image_bytes(folder) -> int:
    """The bytes of every file under `folder`: a dataset's, what the meter divides by."""
    return sum(size for size, *_ in files(folder).values())


def snapshot(roots) -> dict:
    """files() of every folder in `roots`, together."""
    now = {}
    for root in roots:
        now.update(files(root))
    return now


class Meter:
    def __init__(self, dataset_bytes: int):
        self.dataset_bytes = dataset_bytes
        self.steps: dict[str, Counter] = {}
        self._seen: dict[str, set] = {}

    def count(self, step: str, found: dict, relative_to=None) -> None:
        """Count the files of `found` (from files()) for `step`, each once."""
        row = self.steps.setdefault(step, Counter())
        seen = self._seen.setdefault(step, set())
        for path, (size, *stamp) in found.items():
            key = (path, *stamp)
            if key in seen:
                continue
            seen.add(key)
            shown = path.relative_to(relative_to) if relative_to else path
            row[kind_of(shown)] += size

    def new_files(self, step: str, before: dict, roots) -> dict:
        """Count the files under `roots` that are new or rewritten since `before`; returns the
        snapshot now (the next `before`)."""
        now = snapshot(roots)
        self.count(step, {p: v for p, v in now.items() if before.get(p) != v}, None)
        return now

    def total(self, kind: str) -> int:
        return sum(row[kind] for row in self.steps.values())

    def moved(self) -> float:
        """Dataset bytes moved per dataset byte: images and metadata, not the model or the
        download."""
        return (self.total("images") + self.total("metadata")) / self.dataset_bytes

    def table(self, title: str) -> str:
        mb = lambda n: f"{n / 2**20:9.2f}"  # noqa: E731
        lines = [title, f"dataset: {self.dataset_bytes / 2**20:.2f} MiB of images",
                 f"{'step':<22}" + "".join(f"{k:>10}" for k in KINDS) + "  (MiB)"]
        for step, row in self.steps.items():
            lines.append(f"{step:<22}" + "".join(f" {mb(row[k])}" for k in KINDS))
        lines.append(f"{'total':<22}" + "".join(f" {mb(self.total(k))}" for k in KINDS))
        lines.append(f"moved per dataset byte (images + metadata): {self.moved():.3f}")
        return "\n".join(lines)


def local_run_meter(run_root: Path, dataset_bytes: int) -> Meter:
    """The meter of a local pipeline run: every task's outputs under its run folder."""
    meter = Meter(dataset_bytes)
    for task in sorted(p for p in run_root.iterdir() if p.is_dir()):
        meter.count(task.name, files(task), relative_to=task)
    return meter


def accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


class ClusterBranch:
    """The pipeline's steps as they run on a cluster (see the module docstring)."""

    def __init__(self, root: Path, meter: Meter, *, pvc: Path, workspace: Path | None):
        self.root, self.meter, self.pvc, self.workspace = root, meter, pvc, workspace
        self.volumes = [v for v in (pvc, workspace) if v is not None]
        self.store = root / "artifact-store"
        self.pods = 0

    def pod(self) -> Path:
        self.pods += 1
        return Path(self.root / f"pod-{self.pods}")

    def download(self, step: str, artifact: Path, pod: Path) -> Path:
        """KFP's launcher: the input artifact from the store into the pod (counted)."""
        local = pod / "inputs" / artifact.name
        if artifact.is_dir():
            shutil.copytree(artifact, local)
        else:
            local.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(artifact, local)
        self.meter.count(step, files(local), relative_to=pod / "inputs")
        return local

    def upload(self, step: str, outputs: dict) -> dict:
        """KFP's launcher: the step's outputs into the store (counted); their store paths."""
        stored = {}
        for name, path in outputs.items():
            target = self.store / step / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                shutil.copytree(path, target)
            elif path.exists():
                shutil.copyfile(path, target)
            self.meter.count(step, files(target), relative_to=self.store / step)
            stored[name] = target
        return stored

    def run(self, step: str, fn, inputs: dict, outputs: tuple, *args, **kwargs) -> tuple:
        """Run `fn(*args, *downloaded inputs, *output paths, **kwargs)` in a fresh pod; count
        what it writes on the volumes; upload its outputs. Returns (fn's result, {output: store
        path})."""
        pod = self.pod()
        local_in = [self.download(step, a, pod) for a in inputs.values()]
        local_out = {name: pod / "outputs" / name for name in outputs}
        for p in local_out.values():
            p.parent.mkdir(parents=True, exist_ok=True)
        self.current = (step, snapshot(self.volumes))
        kwargs = {k: v for k, v in kwargs.items() if accepts(fn, k)}  # the code measured may
        result = fn(*args, *local_in, *local_out.values(), **kwargs)  # predate an argument
        self.meter.new_files(step, self.current[1], self.volumes)
        return result, self.upload(step, local_out)

    def look(self) -> None:
        """Count what the running step wrote on the volumes so far (called mid-step, e.g. while
        its job runs, so that files it deletes before it ends are counted too)."""
        step, before = self.current
        self.current = (step, self.meter.new_files(step, before, self.volumes))
