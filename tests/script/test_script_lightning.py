"""A PyTorch Lightning script as people bring it (tests/script/styles/lightning/: a
LightningModule and `Trainer(strategy="ddp")`, started by torchrun), run unchanged 2 x 2 on this
machine, Lightning installed from the package index through its own requirements.txt (the image's
torch kept). One run checks what a user sees: the job's progress through `kfvision job status`
while it runs, and the metrics rank 0 printed as curves in its MLflow run (a real `mlflow
server`)."""

import pytest
from helpers.jobstatus import mlflow_history, run_watched, running_progress


@pytest.mark.distributed
@pytest.mark.slow
def test_a_lightning_ddp_script_runs_2x2_its_progress_seen_and_its_curves_in_mlflow(
        tmp_path, micro_digits, mlflow_server, capsys):
    views = run_watched(tmp_path, "lit", "lightning",
                        ["--data", str(micro_digits["train"]), "--val",
                         str(micro_digits["val"]), "--epochs", "3"], mlflow_server, capsys)
    running = running_progress(views)
    assert running, "job status never showed the progress while the job ran"
    assert running[0]["total"] == 3 and set(running[0]["metrics"]) >= {"epoch", "train_loss"}
    final = views[-1]
    assert (final["phase"], final["nodes"], final["procs"]) == ("Succeeded", 2, "2")
    assert (final["progress"]["done"], final["progress"]["percent"]) == (3, 100)
    curve = mlflow_history(mlflow_server, "lit", tmp_path / "logs", "train_loss")
    assert [step for step, _ in curve] == [0, 1, 2]  # the epochs, as Lightning counts them
    assert curve[-1][1] == pytest.approx(final["progress"]["metrics"]["train_loss"], rel=1e-3)
    assert [s for s, _ in mlflow_history(mlflow_server, "lit", tmp_path / "logs",
                                         "val_acc")] == [0, 1, 2]
