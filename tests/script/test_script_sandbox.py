"""A user's script under run-local's sandbox (pipelines/jobs/sandbox.py), as Azure ML's guide
writes it (tests/script/styles/azure_ddp): one run per job kind (2 x 2 and 2 x 1, and one per pod
with `--launcher python`) checks, each from the same run, that

- the guide's `$AZ_BATCHAI_*` arguments reach a working process group (pipelines/script/ranks.py);
- torch hub's pretrained-download pattern writes under the pod's TORCH_HOME (pipelines/jobs/
  home.py), and ./outputs is collected;
- a write under /opt, / or the caller's HOME fails with the pod's error (read-only root);
- each rank's stdout and stderr reach the log in the order the rank wrote them.
"""

import json
import os
import re

import pytest
from helpers.paths import REPO
from test_script import _run_local

from kfvision.pipelines.jobs.sandbox import probe
from kfvision.pipelines.script import boot, ranks

SCRIPT = REPO / "tests" / "script" / "styles" / "azure_ddp"
EROFS = "OSError: [Errno 30] Read-only file system"
needs_bwrap = pytest.mark.skipif(probe()[0] is None, reason=f"no sandbox here: {probe()[1]}")


def _azure_run(tmp_path, capsys, kind, nodes, nproc, launcher="torchrun"):
    forbidden = ["/opt", "/", os.path.expanduser("~")]
    out = tmp_path / "results"
    world = str(nodes * nproc)
    code, log, err = _run_local(tmp_path, [
        "--nodes", str(nodes), "--nproc-per-node", str(nproc), "--launcher", launcher,
        "--source", str(SCRIPT), "--entry", "train.py", "--output-uri", str(out),
        ["--dist-backend", "gloo", "--dist-url", "$AZ_BATCHAI_PYTORCH_INIT_METHOD", "--rank",
         "$AZ_BATCHAI_TASK_INDEX", "--world-size", world, "--literal", "cost$$5",
         "--forbidden", *forbidden]], capsys, kind=kind)
    assert code == 0, err + log
    report = json.loads((out / "outputs" / "report.json").read_text())
    assert (report["world"], report["rank_sum"]) == (int(world), sum(range(int(world))))
    assert report["argv"][:8] == ["--dist-backend", "gloo", "--dist-url", "env://", "--rank",
                                  "0", "--world-size", world]
    assert report["literal"] == "cost$5"
    assert report["uid"] == 1000  # the pod's runAsUser
    assert report["weights"].startswith(report["home"] + "/.cache/torch/hub/checkpoints/")
    assert report["refused"] == {p: EROFS for p in forbidden}
    for rank in range(int(world)):  # in the order the rank wrote them, stdout or stderr
        lines = [m.group(1) for m in re.finditer(rf"\] rank {rank} order (\d)", log)]
        assert lines == ["1", "2", "3"], log
    assert "each ran the whole script" not in log


@needs_bwrap
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind, nproc", [("pytorchjob", 2), ("trainjob", 1)])
def test_azures_ddp_script_runs_unchanged_in_the_pods_filesystem(tmp_path, capsys, kind, nproc):
    """2 x 2 as a PyTorchJob; 2 x 1 (torchrun in each pod) as a TrainJob: what differs with the
    kind is the pods' volumes and environment, which one process a pod meets as two do."""
    _azure_run(tmp_path, capsys, kind, 2, nproc)


@needs_bwrap
@pytest.mark.distributed
def test_azures_arguments_with_one_process_per_pod(tmp_path, capsys):
    _azure_run(tmp_path, capsys, "pytorchjob", 2, 1, launcher="python")


def test_processes_that_join_no_group_are_told_so(tmp_path, capfd, monkeypatch):
    """The boot's summary line, from the rank hook's marks: two processes of the job (the
    operator's WORLD_SIZE), neither calling init_process_group."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "alone.py").write_text("import sys; print('args', sys.argv[1:])\n")
    from kfvision.pipelines.script.snapshot import pack

    snap = pack(src)
    (tmp_path / "snap.tar.gz").write_bytes(snap.data)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    assert boot.main(["--sha256", snap.sha256, "--snapshot", str(tmp_path / "snap.tar.gz"),
                      "--entry", "alone.py", "--launcher", "python", "--work",
                      str(tmp_path / "w"), "--", "$RANK", "$$HOME"]) == 0
    log = capfd.readouterr()
    assert "args ['0', '$HOME']" in log.out
    assert "2 processes each ran the whole script: none joined a process group" in log.err
    assert ranks.alone_line(tmp_path / "w" / "groups", 1) is None  # one process: nothing to say


@pytest.mark.parametrize("text,expected", [
    ("$A", "1"), ("${A}x", "1x"), ("$$A", "$A"), ("$NOPE", "$NOPE"), ("a$", "a$"),
    ("$A$B", "12"), ("$$$A", "$1"), ("${NOPE}", "${NOPE}")])
def test_azure_style_expansion(text, expected):
    from kfvision.pipelines.script.rankhook.sitecustomize import expand

    assert expand(text, {"A": "1", "B": "2"}) == expected
