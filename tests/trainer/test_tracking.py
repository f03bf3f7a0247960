"""MLflow tracking from the trainer, against a real `mlflow server` (SQLite backend, artifacts
proxied into a local folder) on a loopback port: what rank 0 logs, one run across a SIGKILL and
the restart, and training that goes on when the server is down at start or dies mid-run."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest
from helpers.paths import REPO
from helpers.runs import train_argv

from kfvision.pipelines.clients.endpoints import free_port
from kfvision.trainer.tracking import Tracker, failure
from kfvision.trainer.train import main

OPTIONS = {"epochs": 3, "image_size": 32, "batch_size": 16, "lr": 0.05, "augment": "none",
           "print_freq": 100, "workers": 0}


@pytest.fixture(scope="module")
def micro(micro_digits) -> dict:
    """4 training digits and 1 validation digit per class: 3 steps an epoch."""
    return micro_digits


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _runs(uri, experiment):
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


def _steps(uri, run_id, metric="val_loss"):
    return sorted(m.step for m in _client(uri).get_metric_history(run_id, metric))


def _experiment() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def test_rank_0_logs_params_every_epoch_tags_and_the_model(mlflow_server, tmp_path, micro,
                                                          resnet18_dir, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("KFVISION_JOB_KIND", "PyTorchJob")
    exp, out = _experiment(), tmp_path / "model"
    assert main(train_argv(resnet18_dir, micro, out, tracking_uri=mlflow_server,
                           experiment=exp, **OPTIONS)) == 0
    (run,) = _runs(mlflow_server, exp)
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "3" and run.data.params["world_size"] == "1"
    assert "tracking_uri" not in run.data.params
    assert run.data.tags["kfvision.world_size"] == "1"
    assert run.data.tags["kfvision.device"] == "cpu"
    assert run.data.tags["kfvision.job_kind"] == "PyTorchJob"
    history = json.loads((out / "metrics.json").read_text())["history"]
    for name in ("train_loss", "val_loss", "val_top1", "val_top5", "lr", "train_images_per_sec"):
        logged = _client(mlflow_server).get_metric_history(run.info.run_id, name)
        assert sorted(m.step for m in logged) == [1, 2, 3], name
    val = sorted(_client(mlflow_server).get_metric_history(run.info.run_id, "val_loss"),
                 key=lambda m: m.step)
    assert [m.value for m in val] == pytest.approx([h["val_loss"] for h in history])
    names = {a.path for a in _client(mlflow_server).list_artifacts(run.info.run_id)}
    assert {"metrics.json", "config.yaml", "model"} <= names
    model = {a.path for a in _client(mlflow_server).list_artifacts(run.info.run_id, "model")}
    assert {"model/weights.pt", "model/model.json", "model/spec.json"} <= model


def test_mlflow_run_id_is_the_run_logged_into(mlflow_server, tmp_path, micro,
                                              resnet18_dir, monkeypatch):
    """As under KFP 2.17: the task's nested run arrives as MLFLOW_RUN_ID with the URI."""
    client = _client(mlflow_server)
    exp = client.create_experiment(_experiment())
    given = client.create_run(exp).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_RUN_ID", given)
    assert main(train_argv(resnet18_dir, micro, tmp_path / "m", **{**OPTIONS,
                                                                         "epochs": 1})) == 0
    assert _steps(mlflow_server, given) == [1]
    assert len(client.search_runs([exp])) == 1
    assert client.get_run(given).info.status == "RUNNING"  # KFP closes its own runs


KILL_IN_EPOCH_3 = """
    import os, signal, sys
    from kfvision.trainer.engine import Trainer
    real = Trainer.train_one_epoch

    def train_one_epoch(self, epoch):  # epochs 1-2 done, checkpointed and logged
        if epoch == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, epoch)

    Trainer.train_one_epoch = train_one_epoch
    from kfvision.trainer.train import main
    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_run_killed_and_started_again_is_one_mlflow_run_with_each_epoch_once(
        mlflow_server, tmp_path, micro, resnet18_dir, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    exp, out = _experiment(), tmp_path / "model"
    argv = train_argv(resnet18_dir, micro, out, tracking_uri=mlflow_server,
                      experiment=exp, **OPTIONS)
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(KILL_IN_EPOCH_3), *argv],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == -signal.SIGKILL, run.stdout[-2000:] + run.stderr[-2000:]
    (killed,) = _runs(mlflow_server, exp)
    assert _steps(mlflow_server, killed.info.run_id) == [1, 2]
    capsys.readouterr()
    assert main(argv) == 0  # the same command again: resumes from epoch 2
    assert "(epochs 1-2 already there)" in capsys.readouterr().out
    (resumed,) = _runs(mlflow_server, exp)
    assert resumed.info.run_id == killed.info.run_id and resumed.info.status == "FINISHED"
    assert _steps(mlflow_server, resumed.info.run_id) == [1, 2, 3]
    assert _steps(mlflow_server, resumed.info.run_id, "train_loss") == [1, 2, 3]


def test_a_server_down_at_start_is_one_named_line_and_training_goes_on(
        tmp_path, micro, resnet18_dir, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    out = tmp_path / "model"
    assert main(train_argv(resnet18_dir, micro, out, tracking_uri=f"http://127.0.0.1:"
                           f"{free_port()}", **{**OPTIONS, "epochs": 2})) == 0
    log = capsys.readouterr().out
    assert log.count("MLflowTrackingError") == 1, log
    assert "unreachable" in log and "Training goes on" in log
    assert json.loads((out / "metrics.json").read_text())["status"] == "completed"


class _Proxy:
    """A TCP proxy to the server, closed on demand: for the client, the server died."""

    def __init__(self, target_port: int):
        self.target, self.listener = target_port, socket.create_server(("127.0.0.1", 0))
        self.port, self.open, self.conns = self.listener.getsockname()[1], True, []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while self.open:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.conns += [conn, upstream]
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self):  # the listener and every open (keep-alive) connection
        self.open = False
        for s in [self.listener, *self.conns]:  # shutdown wakes the thread blocked in accept
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self.listener.close()


def test_a_server_that_dies_mid_run_is_one_named_line_and_training_goes_on(
        mlflow_server, tmp_path, micro, resnet18_dir, monkeypatch, capsys):
    from kfvision.trainer.engine import Trainer

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    proxy = _Proxy(int(mlflow_server.rsplit(":", 1)[1]))
    real = Trainer.train_one_epoch

    def train_one_epoch(self, epoch):
        if epoch == 2:  # epoch 1 is logged; then the server goes away
            proxy.close()
        return real(self, epoch)

    monkeypatch.setattr(Trainer, "train_one_epoch", train_one_epoch)
    exp, out = _experiment(), tmp_path / "model"
    assert main(train_argv(resnet18_dir, micro, out, experiment=exp,
                           tracking_uri=f"http://127.0.0.1:{proxy.port}", **OPTIONS)) == 0
    log = capsys.readouterr().out
    assert log.count("MLflowTrackingError") == 1 and "logging epoch 2" in log, log
    assert json.loads((out / "metrics.json").read_text())["status"] == "completed"
    (run,) = _runs(mlflow_server, exp)
    assert _steps(mlflow_server, run.info.run_id) == [1]


# Two processes logging into one run: tests/trainer/test_distributed.py (its `kfvision train
# --nproc-per-node 2` run tracks into the session's server).


def test_tracking_is_off_without_a_uri_and_mlflow_is_not_imported():
    from kfvision.trainer.config import TrainConfig

    cfg = TrainConfig(model="m", train="t", val="v", out="o")
    assert Tracker.from_env(cfg, environ={}) is None
    env = {"MLFLOW_TRACKING_URI": "http://x", "MLFLOW_EXPERIMENT_ID": "7", "MLFLOW_RUN_ID": "r"}
    t = Tracker.from_env(cfg, environ=env)
    assert (t.uri, t.experiment_id, t.run_id, t.experiment) == ("http://x", "7", "r", "kfvision")
    code = ("import sys; from kfvision.trainer.tracking import Tracker; "
            "from kfvision.trainer.config import TrainConfig; "
            "Tracker.from_env(TrainConfig('m', 't', 'v', 'o'), {}); "
            "sys.exit('mlflow' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


@pytest.mark.parametrize("exc, kind", [
    (ConnectionRefusedError("refused"), "unreachable"),
    (type("SSLError", (Exception,), {})("bad cert"), "tls"),
    (type("RestException", (Exception,), {"error_code": "UNAUTHENTICATED"})("401"), "auth"),
    (type("RestException", (Exception,), {"error_code": "RESOURCE_DOES_NOT_EXIST"})("x"),
     "missing"),
    (RuntimeError("Internal Server Error"), "refused"),
])
def test_failures_are_classified_once(exc, kind):
    assert failure(exc) == kind


@pytest.mark.slow  # a new SQLite store runs all of MLflow's schema migrations
def test_a_local_sqlite_store_as_the_demo_makes_it(tmp_path, micro, resnet18_dir, monkeypatch):
    """`make demo`'s store: registry.local_store, then the trainer logs into it."""
    from kfvision.pipelines.clients.registry import local_store

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store = local_store(tmp_path / "mlflow")
    assert store["ui"].startswith("mlflow ui --backend-store-uri sqlite:///")
    assert main(train_argv(resnet18_dir, micro, tmp_path / "m", tracking_uri=store["uri"],
                           experiment=store["experiment"], **{**OPTIONS, "epochs": 2})) == 0
    (run,) = _runs(store["uri"], store["experiment"])
    assert _steps(store["uri"], run.info.run_id) == [1, 2]
    assert (tmp_path / "mlflow" / "artifacts").is_dir()  # beside the store, not in the cwd


def test_a_checkpoints_run_missing_on_the_server_means_a_new_run(mlflow_server):
    """A checkpoint carried to another tracking server: its run id is not there."""
    tracker = Tracker(uri=mlflow_server, experiment=_experiment())
    missing = "0" * 32
    run_id = tracker.start({"epochs": 3}, saved_run_id=missing)
    assert run_id and run_id != missing and not tracker.off
    assert _client(mlflow_server).get_run(run_id).data.params == {"epochs": "3"}
