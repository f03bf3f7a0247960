"""bench.objectstore end to end at a tiny size: 200 generated JPEGs pushed to the bench's s3rver
server, LitData's optimize, its chunked and its per-file reads, the node fetcher (each checked by
the bench to have read every image's bytes, or it stops), then the 2-node job on the local folder
and on s3://. Skipped where LitData's venv (`make litdata-venv`) or s3rver (`make s3rver`) is not
there."""

import json

import pytest

import bench
from bench import objectstore, s3rver

pytestmark = [pytest.mark.skipif(not objectstore.LITDATA_PYTHON.exists(),
                                 reason="LitData's venv is not there: make litdata-venv"),
              pytest.mark.skipif(not (s3rver.MODULES / "s3rver").is_dir(),
                                 reason="s3rver is not there: make s3rver")]


@pytest.mark.slow
@pytest.mark.distributed
def test_the_bench_runs_end_to_end_at_200_images(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "BENCH", tmp_path / "results")
    objectstore.main(["--images", "200", "--job", "--epochs", "2",
                      "--litdata-python", str(objectstore.LITDATA_PYTHON.absolute()),
                      "--work", str(tmp_path / "work")])
    record = json.loads((tmp_path / "results" / "objectstore.json").read_text())
    parts = record["parts"]
    assert set(parts) == {"push", "optimize", *objectstore.DEFAULT_READERS}
    for reader in objectstore.DEFAULT_READERS:
        assert parts[reader]["images"] == 200 and parts[reader]["images_per_s"] > 0
        assert parts[reader]["server_cpu_s"] >= 0 and parts[reader]["object_bytes"] > 0
    for ours in ("node",):  # each image once, and the manifest (tens of KB)
        assert 0 < parts[ours]["object_bytes"] - record["dataset_bytes"] < 100_000
    local, s3 = record["job"]["local"], record["job"]["s3"]
    assert local["served_run"] == 0 and s3["served_run"] >= record["dataset_bytes"]
    assert s3["first_step_s"] > 0 and len(s3["history"]) == 2
    assert set(s3["per_node"]) == {"master-0", "worker-0"}
    for node in s3["per_node"].values():  # a node's epoch 1 fetches its share, not the dataset
        assert node["share_bytes"] <= node["epoch_1_bytes"] < record["dataset_bytes"]
    text = (tmp_path / "results" / "objectstore-cpu.md").read_text()
    assert "LitData" in text and "CPU:" in text and "Goal" in text
