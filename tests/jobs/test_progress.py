"""A job's progress from rank 0's `name=value` lines (pipelines/jobs/progress.py): position,
total, percentage, time left, the metrics, and the TrainJob status they make, checked against the
TrainJob CRD's schema for status.trainerStatus."""

import json
from datetime import datetime, timezone

import jsonschema
import pytest
from helpers.k8s_checks import crd_schema
from helpers.paths import SHARED_REFERENCE
from helpers.statusserver import SCHEMA

from kfvision.pipelines.jobs.metriclines import parse_metrics
from kfvision.pipelines.jobs.progress import (
    PROGRESS_TOTAL,
    Progress,
    check_totals,
    from_trainer_status,
    rank0_text,
    rfc3339,
    totals_of,
)
from kfvision.trainer.errors import InvalidParameterError
from kfvision.trainer.trainjob_status import trainer_status

T0 = 1_767_323_045.0  # 2026-01-02T03:04:05Z


def fed(lines, totals=None, start=T0, every=10.0) -> Progress:
    """A Progress fed `lines`, one every `every` seconds from `start`."""
    progress = Progress(totals)
    for i, line in enumerate(lines):
        progress.feed(line, start + i * every)
    return progress


@pytest.mark.parametrize("line,pairs", [
    ("epoch=3 loss=0.412 val-acc=9.5e-1", {"epoch": 3.0, "loss": 0.412, "val-acc": 0.95}),
    ("loss = .5, acc=-1E+2", {"loss": 0.5, "acc": -100.0}),
    ("torch==2.14.1 x=e5 y=+ z=", {}),  # the filter matches these with no number: left out
    ("epoch 3 done", {}),
])
def test_the_pairs_are_katibs(line, pairs):
    assert parse_metrics(line) == pairs


@pytest.mark.parametrize("line,said", [
    ("[0/0] epoch=1 loss=0.5", "epoch=1 loss=0.5"),  # rank 0 of a script
    ("[1/2] epoch=1 loss=0.5", None),  # another rank
    ("[0/-] [kfvision script] ready", None),  # the pod's own line
    ("epoch=1 train-loss=0.5", "epoch=1 train-loss=0.5"),  # the built-in trainer's (untagged)
])
def test_only_rank_zeros_lines_count(line, said):
    assert rank0_text(line) == said


def test_a_printed_total_gives_the_percentage_and_the_pace_the_time_left():
    progress = fed(["epochs=10", "epoch=1 loss=0.9", "epoch=2 loss=0.8", "epoch=3 loss=0.7"])
    snap = progress.snapshot(T0 + 30)
    assert (snap["position"], snap["done"], snap["total"], snap["percent"]) == ("epoch", 3, 10, 30)
    assert snap["eta_s"] == pytest.approx(70.0)  # 10 s an epoch, 7 to go
    assert progress.snapshot(T0 + 50)["eta_s"] == pytest.approx(50.0)  # counted down since
    assert snap["metrics"] == {"epoch": 3, "loss": 0.7}  # the total is no metric


def test_a_script_that_counts_from_zero_is_read_so():
    snap = fed(["num_epochs=4", "epoch=0 acc=0.1", "epoch=1", "epoch=2", "epoch=3"]).snapshot(T0)
    assert (snap["value"], snap["done"], snap["percent"], snap["eta_s"]) == (3, 4, 100, 0.0)


def test_steps_with_a_known_total_win_over_epochs_and_renders_total_wins_over_a_printed_one():
    lines = ["epochs=2 max_steps=100", "step=10 loss=1", "epoch=1 step=50 loss=0.5"]
    snap = fed(lines).snapshot(T0 + 20)
    assert (snap["position"], snap["done"], snap["percent"]) == ("step", 50, 50)
    snap = fed(lines, totals={"max_steps": 200}).snapshot(T0 + 20)
    assert (snap["total"], snap["percent"]) == (200, 25)
    snap = fed(["step=3", "epoch=1"]).snapshot(T0)  # no total: position, no percentage
    assert (snap["position"], snap["percent"], snap["eta_s"]) == ("step", None, None)


def test_no_time_left_from_one_line_and_a_run_that_starts_over_starts_its_pace_again():
    progress = fed(["epochs=5", "epoch=1"])
    assert progress.snapshot(T0 + 10)["eta_s"] is None
    progress = fed(["epochs=5", "epoch=1", "epoch=2", "epoch=1", "epoch=2"], every=10.0)
    assert progress.first["epoch"] == (T0 + 30, 1.0)  # a restarted pod's first epoch again
    resumed = fed(["epochs=5", "epoch=0", "epoch=1", "epoch=2", "epoch=1"])  # from a checkpoint
    assert resumed.done("epoch") == 2  # still counted from 0


def test_a_progress_bar_redrawn_with_carriage_returns_counts_its_last_state():
    progress = fed(["step=1 loss=9\rstep=2 loss=8\rstep=3 loss=7"])
    assert progress.snapshot(T0)["metrics"] == {"step": 3, "loss": 7}


def test_the_status_is_what_the_trainjob_crd_declares():
    parts = ("trainer-v2", "trainer.kubeflow.org_trainjobs.yaml")
    crd = (crd_schema(*parts)["properties"]["status"]["properties"]["trainerStatus"]
           if SHARED_REFERENCE.joinpath(*parts).exists() else SCHEMA)
    many = " ".join(f"m{i}={i}" for i in range(300))
    progress = fed(["epochs=4", f"epoch=1 {'x' * 65}=1 {many}", "epoch=2 loss=0.25"])
    status = progress.trainer_status(T0 + 20)
    jsonschema.validate(status, crd)
    jsonschema.validate(status, SCHEMA)
    assert (status["progressPercentage"], status["estimatedRemainingSeconds"]) == (50, 20)
    names = [m["name"] for m in status["metrics"]]
    assert len(names) == 256 and names[:3] == ["epoch", "m0", "m1"]  # a 65-character name: out
    assert status["lastUpdatedTime"] == "2026-01-02T03:04:25Z"
    values = {m["name"]: m["value"] for m in fed(["epochs=4", "epoch=2 loss=0.25"])
              .trainer_status(T0)["metrics"]}
    assert values == {"epoch": "2", "loss": "0.25", "epochs": "4"}


def test_a_trainjobs_reported_status_reads_back_in_the_same_shape():
    status = fed(["total_steps=8", "step=2 loss=0.5", "step=4 loss=0.25"]).trainer_status(T0 + 10)
    view = from_trainer_status(status, T0 + 15)
    assert (view["position"], view["value"], view["total"], view["percent"]) == ("step", 4, 8, 50)
    assert view["eta_s"] == pytest.approx(15.0) and view["metrics"] == {"step": 4, "loss": 0.25}
    history = [{"epoch": 1, "train_loss": 0.5, "val_top1": 0.9}]  # the built-in trainer's
    built_in = trainer_status(history, 3, 60.0, datetime.fromtimestamp(T0, timezone.utc))
    view = from_trainer_status(json.loads(json.dumps(built_in)), T0)
    assert (view["position"], view["value"], view["total"], view["percent"]) == ("epoch", 1, 3, 33)


def test_totals_from_render_are_checked_and_read_back():
    assert check_totals({"epochs": 10.0}) == {"epochs": 10.0}
    with pytest.raises(InvalidParameterError, match="not a total kfvision reads; use one of "
                                                    "total_steps, max_steps"):
        check_totals({"epoch": 10.0})
    with pytest.raises(InvalidParameterError, match="above 0"):
        check_totals({"max_steps": 0.0})
    assert totals_of({PROGRESS_TOTAL: "epochs=10 bogus=3"}) == {"epochs": 10.0}


def test_the_kubelets_times_are_read_to_the_microsecond():
    assert rfc3339("2026-01-02T03:04:05.123456789Z") == pytest.approx(T0 + 0.123456789)
    assert rfc3339("2026-01-02T05:04:05+02:00") == T0
    assert rfc3339("yesterday") is None
