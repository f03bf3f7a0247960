"""A Hugging Face Accelerate script as people bring it (tests/script/styles/accelerate/: a tiny
model built in code, no hub; `Accelerator().prepare`, started by torchrun), run unchanged 2 x 2 on
this machine, Accelerate installed from the package index through its own requirements.txt (the
image's torch kept). One run checks what a user sees: the job's progress through `kfvision job
status` while it runs, and the metrics rank 0 printed as curves in its MLflow run (a real
`mlflow server`)."""

import pytest
from helpers.jobstatus import mlflow_history, run_watched, running_progress


@pytest.mark.distributed
@pytest.mark.slow
def test_an_accelerate_script_runs_2x2_its_progress_seen_and_its_curves_in_mlflow(
        tmp_path, micro_digits, mlflow_server, capsys):
    views = run_watched(tmp_path, "acc", "accelerate",
                        ["--data", str(micro_digits["train"]), "--epochs", "3"], mlflow_server,
                        capsys)
    running = running_progress(views)
    assert running, "job status never showed the progress while the job ran"
    assert running[0]["position"] == "step" and running[0]["total"] == 9  # 3 steps an epoch
    final = views[-1]
    assert (final["phase"], final["progress"]["done"], final["progress"]["percent"]) == (
        "Succeeded", 9, 100)
    assert final["progress"]["metrics"]["processes"] == 4  # rank 0 saw the whole world
    curve = mlflow_history(mlflow_server, "acc", tmp_path / "logs", "loss")
    assert [step for step, _ in curve] == list(range(1, 10))
    assert curve[-1][1] == pytest.approx(final["progress"]["metrics"]["loss"], rel=1e-3)
