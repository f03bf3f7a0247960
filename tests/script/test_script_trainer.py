"""A Hugging Face Trainer project as its tools teach it (tests/script/styles/hf_trainer/: a
`src/` layout with a pyproject.toml, its console script `train-shapes`, `-e .` in its
requirements.txt beside transformers and accelerate; a tiny ViT from a config, a dataset made in
code), run unchanged 2 x 2 on this CPU-only machine. One run checks what a user sees:

- it is one DDP job of 4 processes (Trainer's own banner: a global batch of 4 x 8, 9 steps), not
  4 models trained alone: the boot set ACCELERATE_USE_CPU=true, and said so;
- the console script ran from the snapshot, the project installed for this job;
- Trainer's log dicts are the job's progress in `job status` while it runs, and its metrics in
  MLflow; its banner's epoch total gives the percentage;
- the model folder Trainer wrote beside itself is named at the end, with how to keep it.

Slow: transformers and accelerate install from the package index into the session's
requirements cache (3.6 min on this loaded 2-core machine; no wheel cache here), then the run
(about 2 min); so it runs in `make test-stress`, not in `make test` (the parsing of Trainer's
lines, the ACCELERATE_USE_CPU default and the outputs left behind have fast tests of their own)."""

import pytest
from helpers.jobstatus import mlflow_history, run_watched, running_progress


@pytest.mark.stress
@pytest.mark.distributed
@pytest.mark.slow
def test_a_trainer_project_trains_one_model_2x2_seen_in_job_status_and_mlflow(
        tmp_path, mlflow_server, capsys):
    views = run_watched(tmp_path, "hf", "hf_trainer", ["--epochs", "3"], mlflow_server, capsys,
                        target=("--console-script", "train-shapes"))
    log = (tmp_path / "logs" / "master-0.log").read_text(errors="replace")
    assert "Total train batch size (w. parallel, distributed & accumulation) = 32" in log
    assert "Total optimization steps = 9" in log  # 96 images / 32: one model, 4 processes
    assert "ACCELERATE_USE_CPU=true: no GPU in the pod" in log
    assert "running hfshapes.train:main (torchrun)" in log
    assert "1 from the snapshot, installed for this job" in log
    assert "vit-tiny-shapes/: 3 files" in log and "--collect vit-tiny-shapes" in log
    assert log.count("{'loss': ") == 9  # each dict a line of its own, no bar glued before it
    running = running_progress(views)
    assert running, "job status never showed the progress while the job ran"
    assert (running[-1]["position"], running[-1]["total"]) == ("epoch", 3)
    final = views[-1]
    assert (final["phase"], final["progress"]["done"], final["progress"]["percent"]) == (
        "Succeeded", 3, 100)
    assert "Epochs" not in final["progress"]["metrics"]  # the banner is no metric
    curve = mlflow_history(mlflow_server, "hf", tmp_path / "logs", "loss")
    assert len(curve) == 9 and [s for s, _ in curve] == sorted({s for s, _ in curve})
    assert curve[-1][1] == pytest.approx(final["progress"]["metrics"]["loss"], rel=1e-3)
