"""A script's processes get their share of the pod's usable cores as OMP_NUM_THREADS, and torch's
intra-op threads with it, as the built-in trainer sizes its own (kfvision.trainer.cpus); a value
the user gives wins; torchrun's banner about setting it to 1 is gone (docs/scripts.md,
"Threads")."""

import argparse
import os

import pytest

from kfvision.pipelines.cli import main
from kfvision.pipelines.script import boot
from kfvision.trainer.cpus import per_process, usable_cpus

SAYS = ("import os, torch\n"
        "print('THREADS', os.environ['RANK'], os.environ.get('OMP_NUM_THREADS'), "
        "torch.get_num_threads(), flush=True)\n")
BANNER = "Setting OMP_NUM_THREADS environment variable"  # torchrun 2.14 run.py, when it sets 1
LIMIT = 2  # cores the job may run on: a pod's CPU limit, as `taskset` would set it


@pytest.fixture
def limited(whole_machine, monkeypatch):
    """The test's process, and so the local pods it starts, on LIMIT cores of the machine (not
    its pytest-xdist worker's share), with no OMP_NUM_THREADS of the tests' own (tests/conftest.py
    sets one): the usable cores of a pod under a CPU limit."""
    every = sorted(os.sched_getaffinity(0))
    if len(every) < LIMIT:
        pytest.skip(f"needs {LIMIT} cores to limit the job to; this machine has {len(every)}")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    os.sched_setaffinity(0, every[:LIMIT])
    yield usable_cpus()
    os.sched_setaffinity(0, every)


def run(tmp_path, capsys, procs: int, *flags) -> tuple:
    """A 1 x `procs` job of SAYS: ({rank: (OMP_NUM_THREADS, torch's threads)}, its output)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "threads.py").write_text(SAYS)
    code = main(["job", "run", "--name", "threads", "--image", "img", "--nproc-per-node",
                 str(procs), "--source", str(tmp_path / "src"), "--entry", "threads.py", *flags,
                 "-o", str(tmp_path / "job.yaml"), "--log-dir", str(tmp_path / "logs")])
    captured = capsys.readouterr()
    log = captured.out + captured.err
    assert code == 0, log
    seen = {}
    for line in log.splitlines():
        if "] THREADS " in line:
            rank, omp, torch_threads = line.split("] THREADS ", 1)[1].split()
            seen[int(rank)] = (omp, int(torch_threads))
    assert sorted(seen) == list(range(procs)), log
    return seen, log


@pytest.mark.distributed
def test_each_process_gets_its_share_of_the_usable_cores(tmp_path, capsys, limited):
    """3 processes on 2 cores: fewer cores than processes, at least one each. The other pods'
    shares (the whole share for one process, one each for two) add no rule that this wiring and
    test_cpus.py's arithmetic do not already check; torchrun's banner is printed only for more
    than one process."""
    procs = 3
    seen, log = run(tmp_path, capsys, procs)
    each = max(1, limited // procs)
    assert set(seen.values()) == {(str(each), each)}, log
    assert f"{procs} process(es), OMP_NUM_THREADS={each} each ({limited} usable core(s) / " \
           f"{procs})" in log
    assert BANNER not in log


@pytest.mark.distributed
def test_a_value_the_user_gives_wins(tmp_path, capsys, limited):
    given = LIMIT  # not LIMIT // 2, kfvision's; at most the cores, which torch's threads keep to
    seen, log = run(tmp_path, capsys, 2, "--env", f"OMP_NUM_THREADS={given}")
    assert set(seen.values()) == {(str(given), given)}, log
    assert f"2 process(es), OMP_NUM_THREADS={given} each (as given)" in log
    assert BANNER not in log


@pytest.mark.parametrize("launcher, nproc, gpus, procs", [
    ("torchrun", "4", 0, 4), ("torchrun", None, 0, 1), ("torchrun", "auto", 2, 2),
    ("torchrun", "gpu", 8, 8), ("torchrun", "auto", 0, os.cpu_count()),
    ("torchrun", "cpu", 0, os.cpu_count()), ("python", "4", 0, 1)])
def test_the_processes_of_a_pod_are_torchruns_nproc_per_node(launcher, nproc, gpus, procs):
    args = argparse.Namespace(launcher=launcher, gpus=gpus)
    environ = {} if nproc is None else {boot.NPROC: nproc}
    assert boot.processes_per_pod(args, environ) == procs
    assert per_process(procs, 16) == max(1, 16 // procs)
