"""Shared fixtures: real data (scikit-learn's digits) written and converted at test time, and what
several files would otherwise each rebuild (640 px JPEG digits, a 2 x 2 CPU job, a fake clock),
made once a run: under pytest-xdist (`make test` runs two workers) the workers share one copy
(`made_once`). Tests marked `gpu` skip, saying why, where PyTorch sees no CUDA device."""

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image

from pipelines.clients.endpoints import free_port
from pipelines.demo import write_digits
from trainer.data.convert import convert
from trainer.model.arch import write_untrained_model

REPO = Path(__file__).resolve().parent.parent
SHARED_REFERENCE = REPO.parent / "shared" / "reference"


WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))  # 0: not under pytest-xdist

if WORKERS:
    # Each worker runs on its own share of the cores (`make test`: 2 workers, one core each), it
    # and every process it starts: a training takes its threads from the cores it may run on
    # (trainer.distributed.usable_cpus), and two trainings that each took the whole machine
    # spin their OpenMP threads against each other (an in-process training ran 6x slower).
    ALL_CORES = sorted(os.sched_getaffinity(0))
    _index = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    if len(ALL_CORES) >= WORKERS:
        os.sched_setaffinity(0, ALL_CORES[_index % WORKERS::WORKERS])
    else:  # more workers than cores: they take turns on a core, one thread each
        os.sched_setaffinity(0, {ALL_CORES[_index % len(ALL_CORES)]})
    THREADS = len(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)


@pytest.fixture
def whole_machine():
    """The test runs on every core, not on its pytest-xdist worker's share (given back after):
    for what needs several cores to run at all, such as convert's pool of processes."""
    if not WORKERS:
        yield
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, ALL_CORES)
    yield
    os.sched_setaffinity(0, mine)


def pytest_configure(config):
    """pytest-xdist hands out files in the order collected below, not re-sorted by how many tests
    each holds (its default: the 3 long resume drills went last, and one worker ran them alone
    for 90 s while the other waited). The option is pytest-xdist 3.8.0's `--loadscope-reorder`,
    dest "loadscopereorder", default True (xdist/plugin.py), read by
    xdist/scheduler/loadscope.py's LoadScopeScheduling.schedule, which loadfile inherits."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip, saying why, where PyTorch sees no CUDA device. Under pytest-xdist
    (`--dist loadfile` hands out whole files), the files with slow or distributed tests come
    first, so that the workers finish together rather than one waiting on a long file last."""
    if WORKERS:
        heavy = {item.module.__name__ for item in items
                 if item.get_closest_marker("slow") or item.get_closest_marker("distributed")}
        items.sort(key=lambda item: item.module.__name__ not in heavy)  # stable: order kept within
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here "
                            "(CUDA build of torch, a GPU and its driver)")
    for item in items:
        if item.get_closest_marker("gpu"):  # not `in item.keywords`: that holds parameter ids too
            item.add_marker(skip)


def reference_file(*parts) -> Path:
    """A file of ../shared/reference (upstream CRDs, too large to keep in this repository). Skips
    the calling test, saying why, when that folder is not beside the repository (a clone on its
    own); CI has it, so the checks run there."""
    path = SHARED_REFERENCE.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"{path} is absent: the upstream reference files live in ../shared/reference "
                    "beside the repository (CI has them); a clone on its own skips this check")
    return path


# Keep tests from spreading over more threads than the 2 CI cores have.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def made_once(tmp_path_factory, name: str, make):
    """`make(folder)` run once a test run in a new folder `name`; returns what it returned (a
    JSON value, in which Paths are kept). The workers of pytest-xdist share it: the first to ask
    makes it under a file lock in their common temporary root, the others wait and read it. A
    make that fails is tried again by the next worker that asks, and fails there too."""
    if not WORKERS:
        return make(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent / "made-once"
    root.mkdir(exist_ok=True)
    folder, done = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            value = make(folder)
            done.write_text(json.dumps(value, default=lambda p: {"path": str(p)}))
    return json.loads(done.read_text(),
                      object_hook=lambda d: Path(d["path"]) if d.keys() == {"path"} else d)


def _converted(root: Path, limit=None) -> dict:
    write_digits(root / "raw", limit=limit)
    out = {}
    for split in ("train", "val"):
        convert(root / "raw" / split, root / split, progress=False)
        out[split] = root / split
    out["raw"] = root / "raw"
    return out


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> dict:
    """All 1,797 digits: {"train", "val", "raw"} paths (80/20 stratified split, seed 1)."""
    return made_once(tmp_path_factory, "digits", _converted)


@pytest.fixture(scope="session")
def tiny_digits(tmp_path_factory) -> dict:
    """30 digits per class (24 train / 6 val): for tests that only need something to run."""
    return made_once(tmp_path_factory, "tiny_digits", lambda root: _converted(root, limit=30))


@pytest.fixture(scope="session")
def micro_digits(tmp_path_factory) -> dict:
    """5 digits per class (4 train / 1 val): 3 steps an epoch at batch 16."""
    return made_once(tmp_path_factory, "micro", lambda root: _converted(root, limit=5))


def jpeg_digits(data: dict, root: Path, size: int) -> Path:
    """`data`'s raw validation digits as `size` px JPEGs (quality 90), converted: root/data."""
    for f in sorted((data["raw"] / "val").glob("*/*")):
        dest = root / "src" / f.parent.name / (f.stem + ".jpg")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(f) as im:
            im.convert("RGB").resize((size, size), Image.Resampling.BICUBIC).save(dest, quality=90)
    convert(root / "src", root / "data", progress=False)
    return root / "data"


@pytest.fixture(scope="session")
def digits_640(tiny_digits, tmp_path_factory) -> Path:
    """tiny_digits' validation digits as 640 px JPEGs (quality 90), converted: large enough that
    a 32 px model's resize decodes them at reduced (DCT-scaled) size."""
    return made_once(tmp_path_factory, "digits_640",
                     lambda root: jpeg_digits(tiny_digits, root, 640))


@pytest.fixture(scope="session")
def resnet18_dir(tmp_path_factory) -> Path:
    def make(root):
        write_untrained_model(root / "resnet18", "resnet18")
        return root / "resnet18"

    return made_once(tmp_path_factory, "models", make)


def fake_cpu(monkeypatch, flags, model: str = "a CPU") -> None:
    """Make the running CPU (trainer.fastpath.cpu_info, what every speed choice reads) `model`
    with `flags`, its kernels uncapped (no ONEDNN_MAX_CPU_ISA)."""
    monkeypatch.setattr("trainer.fastpath.cpu_info", lambda: (model, frozenset(flags)))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)


def train_argv(model, data: dict, out, **options) -> list:
    """Flags for trainer.train.main / `kfvision train` (options as python names)."""
    argv = ["--model", str(model), "--train", str(data["train"]), "--val", str(data["val"]),
            "--out", str(out)]
    for k, v in options.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    return argv


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory, tiny_digits, resnet18_dir) -> Path:
    """A resnet18 trained for 2 epochs on tiny_digits (a real trained model directory, fast)."""
    from trainer.train import main

    def make(root):
        rc = main(train_argv(resnet18_dir, tiny_digits, root / "model", epochs=2, image_size=32,
                             batch_size=16, lr=0.05, augment="none", print_freq=100))
        assert rc == 0
        return root / "model"

    return made_once(tmp_path_factory, "trained", make)


# --- s3:// against a real S3 API server on loopback (moto's standalone server) ---------------

@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on a free loopback port, for the session: its http:// URL."""
    import logging

    from moto.server import ThreadedMotoServer

    # werkzeug would attach a handler to whatever sys.stderr is at its first request (one test's
    # capture, closed by the next): its request log goes nowhere instead
    quiet = logging.getLogger("werkzeug")
    quiet.addHandler(logging.NullHandler())
    quiet.setLevel(logging.ERROR)
    quiet.propagate = False
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _fast_retries():
    from pipelines.clients.s3 import RetryPolicy

    return RetryPolicy(base_s=0.01, cap_s=0.2, total_s=20.0, connect_timeout_s=5.0,
                       read_timeout_s=10.0)


FAST_RETRIES = _fast_retries()


class S3Bucket:
    """A fresh bucket on the test server, and helpers to fill it."""

    def __init__(self, name: str, endpoint: str):
        from pipelines.clients import s3

        self.name, self.endpoint = name, endpoint
        self.client = s3.client()
        self.client.create_bucket(Bucket=name)

    def uri(self, key: str = "") -> str:
        return f"s3://{self.name}/{key}"

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.name, Key=key, Body=data)

    def upload_folder(self, folder: Path, prefix: str) -> int:
        """Every file under `folder` to `prefix` (paths kept); returns how many."""
        files = [p for p in sorted(Path(folder).rglob("*")) if p.is_file()]
        for p in files:
            self.put(prefix + p.relative_to(folder).as_posix(), p.read_bytes())
        return len(files)


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch, tmp_path, request) -> S3Bucket:
    """The standard AWS variables pointed at the test server (dummy credentials, no config
    files), and a new bucket named after the test."""
    import re

    from pipelines.clients import s3

    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret-never-shown")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # retries as the default policy, but waits short enough for tests (also resets the clients)
    old = s3.set_retry_policy(FAST_RETRIES)
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-") + "-bkt"
    yield S3Bucket(name, s3_endpoint)
    s3.set_retry_policy(old)


# --- a small filesystem that fills up ------------------------------------------------------

FILLER = "filler.bin"


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a folder on a new tmpfs of that size (e.g. "2m"), unmounted afterwards: a
    small filesystem to fill up. Skips the test, saying why, where it cannot be mounted."""
    mounted = []

    def mount(size: str = "2m") -> Path:
        folder = tmp_path / f"vol{len(mounted)}"
        folder.mkdir()
        try:
            run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                  str(folder)], capture_output=True, text=True)
            why = (run.stderr or run.stdout).strip() if run.returncode else None
        except OSError as e:  # no mount(8) here
            why = str(e)
        if why is not None:
            pytest.skip(f"cannot mount a tmpfs to fill up (needs root or CAP_SYS_ADMIN): {why}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(folder: Path, leave: int) -> None:
    """Fill the volume of `folder` until `leave` bytes are free (a file `filler.bin`)."""
    todo = max(shutil.disk_usage(folder).free - leave, 0)
    chunk = b"\0" * (1 << 20)
    try:
        with open(folder / FILLER, "ab") as f:
            while todo > 0:
                todo -= f.write(chunk[:todo])
    except OSError as e:  # full a little early (blocks for the file itself): full is the point
        if e.errno != errno.ENOSPC:
            raise


def free_up(folder: Path) -> None:
    (folder / FILLER).unlink()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` (SQLite backend, artifacts proxied into a local folder) on a free
    loopback port, one per session: yields its URI. Skips when mlflow (the `test` extra) is
    missing."""
    import shutil
    import subprocess
    import sys
    import time
    import urllib.request

    if shutil.which("mlflow", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mlflow server not installed (pip install -e '.[test]')")
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    # no telemetry; no job runner (its huey consumers are eight more processes we do not use)
    env = {**os.environ, "MLFLOW_ENABLE_TELEMETRY": "false", "DO_NOT_TRACK": "true",
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(root / "server.log", "wb") as logfile:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
             f"sqlite:///{root}/mlflow.db", "--artifacts-destination", str(root / "artifacts"),
             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            stdout=logfile, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()}")
            time.sleep(0.3)
        yield uri
    finally:  # the server's own process group (its workers too)
        import signal

        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def trained_tiny_onnx(trained_tiny, tmp_path_factory) -> tuple:
    """trained_tiny exported to ONNX once a session (exporting is the slow part): (path, the
    metadata `export` wrote)."""
    from trainer.use.export import export

    return tuple(made_once(tmp_path_factory, "onnx", lambda root: [
        root / "model.onnx", export(trained_tiny, "onnx", root / "model.onnx")]))


@pytest.fixture(scope="session")
def served_digits(trained_tiny, tmp_path_factory):
    """`kfvision serve` of trained_tiny as model "digits" (--max-batch-size 8), one a session:
    the protocol tests (v1, v2 REST and gRPC, every client, hostile requests, /metrics) speak to
    it. A test that needs other server options starts its own."""
    from pipelines.serve.client import Server

    server = Server(["--model", trained_tiny, "--name", "digits", "--max-batch-size", "8"],
                    tmp_path_factory.mktemp("serve") / "server.log")
    yield server
    server.stop()


# The CPU job that the distributed tests compare: 3 epochs of micro_digits (40 images) at 32 px,
# batch 4 on each of 4 processes (3 steps an epoch), with a progress line at every step (what the
# fault drills of test_resume_exact.py wait for), so that one unbroken run serves them all.
JOB_FLAGS = ["--epochs", "3", "--image-size", "32", "--batch-size", "4", "--lr", "0.005",
             "--augment", "light", "--print-freq", "1", "--seed", "5", "--workers", "0",
             "--patience", "10"]


def run_job(root: Path, data: dict, model, *, kind="pytorchjob", nodes=2, nproc=2) -> dict:
    """Render a `nodes` x `nproc` CPU job of `kind` (JOB_FLAGS) with `kfvision job render`, run
    it with `kfvision job run-local`.

    Returns {"rc": run-local's exit code, "out": the model directory, "metrics": its
    metrics.json, "logs": the log folder}.
    """
    from pipelines.cli import main

    name = f"digits-{kind}-{nodes}x{nproc}"
    out, manifest, logs = root / f"model-{name}", root / f"{name}.yaml", root / f"logs-{name}"
    kind_flags = ["--kind", "trainjob", "--runtime", "kfvision-torch"] if kind == "trainjob" \
        else []
    assert main(["job", "render", *kind_flags, "--name", name, "--image", "local",
                 "--nodes", str(nodes), "--procs-per-node", str(nproc), "--model", str(model),
                 "--train", str(data["train"]), "--val", str(data["val"]), "--out", str(out),
                 *JOB_FLAGS, "-o", str(manifest)]) == 0
    rc = main(["job", "run-local", str(manifest), "--quiet", "--log-dir", str(logs)])
    return {"rc": rc, "out": out, "metrics": json.loads((out / "metrics.json").read_text()),
            "logs": logs}


@pytest.fixture(scope="session")
def pytorchjob_2x2(tmp_path_factory, micro_digits, resnet18_dir) -> dict:
    """The 2 nodes x 2 processes PyTorchJob of `run_job` on micro_digits, run once a session:
    what the 1 x 4 PyTorchJob, the 2 x 2 TrainJob and the jobs killed and resumed are compared
    with (the same model from the same data, seed and world size is the claim, whatever the
    data's size)."""
    return made_once(tmp_path_factory, "pytorchjob_2x2",
                     lambda root: run_job(root, micro_digits, resnet18_dir))


class FakeClock:
    """A clock that moves only when slept on: `clock()` is the time, `clock.sleep(s)` moves it.
    Waits of any length take no real time (pass `sleep=clock.sleep, clock=clock`)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds
