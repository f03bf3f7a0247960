"""Shared fixtures: real data (scikit-learn's digits) written and converted at test time, and what
several files would otherwise each rebuild (640 px JPEG digits, a 2 x 2 CPU job, a fake clock),
made once a run: under pytest-xdist (`make test` runs two workers) the workers share one copy
(`made_once`). Tests marked `gpu` skip, saying why, where PyTorch sees no CUDA device."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.runs import DIGITS_RUN, jpeg_digits, run_job, train_argv
from helpers.s3bucket import FAST_RETRIES, S3Bucket
from helpers.workunits import UNITS_FILE, HeavyAloneScheduling, order, work_units, write_units

from kfvision.pipelines.clients.endpoints import free_port
from kfvision.pipelines.flow.demo import write_digits
from kfvision.trainer.data.convert import convert
from kfvision.trainer.model.arch import write_untrained_model

# helpers.cost: markers by cost (an unmarked test that costs too much fails); pytester for its test
pytest_plugins = ["helpers.cost", "pytester"]

# kfvision has one import name: its folders are kfvision.trainer and kfvision.pipelines, from the
# install (setup.py). The repository root is on sys.path for bench/ and tools/, which would also
# make the folders importable as `trainer` and `pipelines`, a second copy of every module: an
# import of either fails here instead (None in sys.modules: "import of trainer halted").
for _bare in ("trainer", "pipelines"):
    sys.modules[_bare] = None

# Byte code is written (to the __pycache__ folders .gitignore leaves out) even where
# PYTHONDONTWRITEBYTECODE is set: without it each pytest-xdist worker rewrote and compiled every
# test module again (10 s of CPU a worker), and every process a test starts compiled kfvision's
# modules again (0.15 s each, a few hundred processes a run). What a test proves is the same.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))  # 0: not under pytest-xdist

if WORKERS:
    # Each worker runs on its own share of the cores (`make test`: 2 workers, one core each), it
    # and every process it starts: a training takes its threads from the cores it may run on
    # (kfvision.trainer.cpus.usable_cpus), and two trainings that each took the whole machine
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
    if not WORKERS and getattr(config.option, "numprocesses", None):  # the controller
        import tempfile

        os.environ[UNITS_FILE] = str(Path(tempfile.mkdtemp(prefix="kfvision-units-")) / "u.json")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: without it (-p no:xdist) unused
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` hands out a heavy test alone (helpers/workunits.py)."""
    if config.getvalue("dist") == "loadfile":
        return HeavyAloneScheduling(config, log)
    return None


# Session fixtures that start a process importing torch for the tests that ask for them (one
# `kfvision serve` the protocol tests share). The cost check cannot see a process a wider fixture
# started, so a test that asks for one is marked `process` here, as it would be had it started
# the server itself: `make test-fast` runs no torch process (docs/development.md, the tiers).
TORCH_PROCESS_FIXTURES = ("served_digits",)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_itemcollected(item):
    if any(name in item.fixturenames for name in TORCH_PROCESS_FIXTURES):
        item.add_marker(pytest.mark.process)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip, saying why, where PyTorch sees no CUDA device; `stress` tests run
    only when `-m` names them. Under pytest-xdist the heavy units come first (a heavy test alone,
    else whole files: helpers/workunits.py), so that the workers finish together rather than
    one waiting on a long file last."""
    if "stress" not in (config.getoption("markexpr") or ""):  # only when asked: make test-stress
        stress = [item for item in items if item.get_closest_marker("stress")]
        if stress:
            config.hook.pytest_deselected(items=stress)
            items[:] = [item for item in items if not item.get_closest_marker("stress")]
    if WORKERS:
        units = work_units(items)
        place = order(items, units)
        items.sort(key=lambda item: place[units[item]])  # stable: order kept within a unit
        write_units(units)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here "
                            "(CUDA build of torch, a GPU and its driver)")
    for item in items:
        if item.get_closest_marker("gpu"):  # not `in item.keywords`: that holds parameter ids too
            item.add_marker(skip)


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
def photos(tmp_path_factory) -> Path:
    """96 labelled JPEGs of 400x300 (about 60 KB each, like small photos) in 4 class folders:
    what the data-movement meter (tests/helpers/meter.py) weighs a run's bytes against."""
    def make(root):
        from bench.jpegset import make_jpeg_set

        make_jpeg_set(root / "gen", images=96, classes=4, size=(400, 300))
        shutil.move(root / "gen" / "raw", root / "photos")
        shutil.rmtree(root / "gen")
        return root / "photos"

    return made_once(tmp_path_factory, "photos", make)


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


@pytest.fixture(scope="session")
def digits_trained(tmp_path_factory, digits, resnet18_dir) -> dict:
    """The digits trained as DIGITS_RUN says, every other option at its default (at 32 px on a
    CPU: fp32, one-pixel convolutions as GEMM, the decoded images cached), once a test run:
    {"out": the model directory, "final": its final metrics}. test_train.py holds it to a real
    accuracy; test_fastpath.py holds the whole fast path to it."""
    from kfvision.trainer.train import main

    def make(root):
        assert main(train_argv(resnet18_dir, digits, root / "model", **DIGITS_RUN)) == 0
        metrics = json.loads((root / "model" / "metrics.json").read_text())
        return {"out": root / "model", "final": metrics["final"]}

    return made_once(tmp_path_factory, "digits_trained", make)


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory, tiny_digits, resnet18_dir) -> Path:
    """A resnet18 trained for 2 epochs on tiny_digits (a real trained model directory, fast)."""
    from kfvision.trainer.train import main

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


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch, tmp_path, request) -> S3Bucket:
    """The standard AWS variables pointed at the test server (dummy credentials, no config
    files), and a new bucket named after the test."""
    import re

    from kfvision.pipelines.clients import s3

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
    from kfvision.trainer.use.export import export

    return tuple(made_once(tmp_path_factory, "onnx", lambda root: [
        root / "model.onnx", export(trained_tiny, "onnx", root / "model.onnx")]))


@pytest.fixture(scope="session")
def served_digits(trained_tiny, tmp_path_factory):
    """`kfvision serve` of trained_tiny as model "digits" (--max-batch-size 8), one a session:
    the protocol tests (v1, v2 REST and gRPC, every client, hostile requests, /metrics) speak to
    it. A test that needs other server options starts its own."""
    from kfvision.pipelines.serve.client import Server

    server = Server(["--model", trained_tiny, "--name", "digits", "--max-batch-size", "8"],
                    tmp_path_factory.mktemp("serve") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def wheel_python(tmp_path_factory) -> Path:
    """The python of a fresh environment with kfvision installed from its wheel, as the image has
    it (helpers/wheelinstall.py): built once a run, shared by the pytest-xdist workers."""
    from helpers.wheelinstall import wheel_install

    return made_once(tmp_path_factory, "wheel_install", wheel_install)


@pytest.fixture(scope="session")
def pytorchjob_2x2(tmp_path_factory, micro_digits, resnet18_dir) -> dict:
    """The 2 nodes x 2 processes PyTorchJob of `run_job` on micro_digits, run once a session:
    what the 1 x 4 PyTorchJob, the 2 x 2 TrainJob and the jobs killed and resumed are compared
    with (the same model from the same data, seed and world size is the claim, whatever the
    data's size)."""
    return made_once(tmp_path_factory, "pytorchjob_2x2",
                     lambda root: run_job(root, micro_digits, resnet18_dir))


@pytest.fixture
def fake_registry():
    """A FAKE Kubeflow Model Registry on a loopback port (helpers/fake_registry.py)."""
    from helpers.fake_registry import FakeModelRegistry
    from helpers.paths import reference_yaml

    spec = reference_yaml("model-registry", "model-registry-v1alpha3.openapi.yaml")
    fake = FakeModelRegistry(spec)
    yield fake
    fake.server.shutdown()


@pytest.fixture(autouse=True)
def _crashes_said_where_pytest_says_them(request):
    """After each test, the fault handler writes to pytest's stderr again: torch's `record` (the
    launcher's entry, run in this process by some tests) enables it on the test's captured
    stderr, whose file is gone once the test ends, so a worker that later crashed died silent
    (a segfault of a pytest-xdist worker left only "node down")."""
    import faulthandler

    # pytest's dup of the run's stderr (src/_pytest/faulthandler.py at 9.2.0, the pinned pytest)
    from _pytest.faulthandler import fault_handler_stderr_fd_key

    yield
    fd = request.config.stash.get(fault_handler_stderr_fd_key, None)
    if fd is not None:
        faulthandler.enable(file=fd, all_threads=True)


@pytest.fixture(autouse=True)
def _our_loggers_as_found():
    """Our loggers as each test found them: a test that runs the boot's code in this process
    (its reporters route the trainer's warnings through the boot's `say` and stop them
    propagating, as a boot process should) must not change what the next test's lines do."""
    import logging

    loggers = [logging.getLogger(name) for name in ("trainer", "kfvision")]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, handlers, level, propagate in saved:
        lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate
