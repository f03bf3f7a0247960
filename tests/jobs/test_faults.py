"""When things go wrong: exit codes through torchrun and the pod, and faults injected into
`run-local` (a killed pod) that the job survives by restarting. A real training killed mid-epoch
and resumed from its checkpoint, bit for bit: test_resume_exact.py; checkpoint contents and
single-process resume: test_checkpoint.py."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.paths import REPO
from helpers.replicas import NODE_0_WAITS
from helpers.runs import JOB_FLAGS
from test_job_local import make_job

from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.faults import Fault
from kfvision.pipelines.jobs.pytorchjob.local import run_local, should_restart
from kfvision.trainer import exitcodes
from kfvision.trainer.errors import InvalidDatasetError, NonFiniteLossError, OutputError

# --- the exit-code table -------------------------------------------------------------------------


@pytest.mark.parametrize("failures, code", [
    ([(2, 10)], 2),                        # bad input
    ([(-9, 10), (-15, 11)], 137),          # one process OOM-killed, torchrun SIGTERMed the other
    ([(-15, 11), (-9, 10)], 137),          # the first failure is the cause, whatever the order
    ([(-15, 10), (3, 11)], 3),             # a permanent failure wins over the stopped sibling
    ([(200, 10), (-15, 11)], 200),         # lost a peer in another pod
    ([(200, 10), (2, 12)], 2),             # bad input, even if a peer noticed first
    ([(1, 10)], 1),                        # a bug: permanent
    ([(-6, 10)], 134),                     # SIGABRT (the NCCL watchdog)
    ([], 1),
])
def test_a_nodes_exit_code_comes_from_its_failed_processes(failures, code):
    assert exitcodes.for_failures(failures) == code


def _dist(name):
    return getattr(torch.distributed, name)("connect() timed out")


@pytest.mark.parametrize("exc, code", [
    (InvalidDatasetError("x"), 2), (NonFiniteLossError("x"), 3), (OutputError("x"), 4),
    (_dist("DistNetworkError"), 200), (_dist("DistStoreError"), 200),
    (_dist("DistBackendError"), 200),
    (RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
                  "[127.0.0.1]:62605: Connection reset by peer."), 200),
    (RuntimeError("DataLoader worker (pid 123) is killed by signal: Killed."), 200),
    (ConnectionResetError(104, "Connection reset by peer"), 200),
    (KeyboardInterrupt(), 130),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), None),  # a bug: traceback, 1
    (ValueError("x"), None), (KeyError("x"), None),
])
def test_an_exception_in_a_training_process_maps_to_its_exit_code(exc, code):
    assert exitcodes.for_exception(exc) == code


def test_permanent_codes_fail_and_the_others_retry_under_restart_policy_exitcode():
    for code in (1, 2, 3, 4):
        assert not exitcodes.is_retryable(code) and not should_restart("ExitCode", code)
    for code in (130, 134, 137, 143, 200):
        assert exitcodes.is_retryable(code) and should_restart("ExitCode", code)


# --- kfvision.trainer.launch: torchrun with the exit codes kept
# -------------------------------------------

CHILD = """
    import os, signal, sys, time
    rank = int(os.environ["LOCAL_RANK"])
    mode = sys.argv[1]
    if mode == "exit" or (mode == "rank1-exit" and rank == 1):
        time.sleep(0.3 * rank)
        sys.exit(int(sys.argv[2]))
    if mode == "rank1-kill" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "ready":
        print("ready", flush=True)
    time.sleep(60)
"""


def _launch(tmp_path, *args, env=None, nproc=2, standalone=True):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    flags = ["--standalone"] if standalone else []
    return subprocess.Popen(
        [sys.executable, "-m", "kfvision.trainer.launch", *flags, f"--nproc-per-node={nproc}",
         "--monitor-interval=0.1", str(script), *args],
        cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)


@pytest.mark.distributed
@pytest.mark.parametrize("args, code, first", [
    (["exit", "2"], 2, 0),              # bad input on every rank
    (["rank1-exit", "3"], 3, 1),        # NaN on one rank; torchrun SIGTERMs the other
    (["rank1-kill"], 137, 1),           # the OOM killer took one rank
])
def test_the_launcher_exits_with_what_its_processes_mean(tmp_path, args, code, first):
    proc = _launch(tmp_path, *args)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == code, out
    assert f"[kfvision launch] exiting with {code}: {exitcodes.describe(code)}" in out
    # the rank that failed, never one its launcher stopped in the same second
    assert (f"[kfvision launch] FAILED: rank {first} on node 0 exited with {code} "
            f"({exitcodes.describe(code)}) after ") in out, out
    if first == 1:
        assert out.rstrip().splitlines()[-2].endswith("; stopped: rank 0 on node 0"), out


@pytest.mark.distributed
def test_a_pod_that_is_deleted_or_evicted_exits_143_and_stops_its_processes(tmp_path):
    proc = _launch(tmp_path, "ready")
    for _ in range(300):  # wait until the children run
        if proc.stdout.readline().startswith("ready"):
            break
    proc.send_signal(signal.SIGTERM)  # what the kubelet sends
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "got SIGTERM: stopped the training processes" in out


@pytest.mark.distributed
def test_a_rendezvous_that_times_out_is_retried(tmp_path):
    # a Worker whose Master never comes up: torchrun's static rendezvous, as in a PyTorchJob
    env = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "127.0.0.1",
           "PET_MASTER_PORT": "9", "PET_NPROC_PER_NODE": "1"}  # port 9: nobody listens
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    run = subprocess.run([sys.executable, "-m", "kfvision.trainer.launch", "--rdzv-conf",
                          "timeout=1",
                          str(script), "exit", "0"], cwd=REPO, env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 200, run.stderr[-3000:]
    assert "rendezvous failed" in run.stderr


# --- fault injection on run-local ----------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("worker-0/1:KILL:epoch 2 \\[", Fault("worker-0/1", "epoch 2 \\[", signal.SIGKILL)),
    ("master-0:SIGTERM:done: best", Fault("master-0", "done: best", signal.SIGTERM)),
    ("worker-3:INT:a:b", Fault("worker-3", "a:b", signal.SIGINT)),  # the pattern may hold ':'
])
def test_faults_parse_as_target_signal_pattern(text, expected):
    assert Fault.parse(text) == expected


@pytest.mark.parametrize("text, message", [
    ("worker-0:KILL", "not TARGET:SIGNAL:PATTERN"),
    ("worker-0:BOOM:x", "'BOOM' is not a signal name"),
    ("node-1:KILL:x", "not a replica such as master-0"),
    ("worker-0:KILL:(", "not a regular expression"),
])
def test_bad_faults_are_refused_with_what_to_write(text, message):
    with pytest.raises(InvalidJobError, match=message.replace("(", r"\(")):
        Fault.parse(text)


def test_a_fault_must_name_a_replica_of_the_job(tmp_path):
    job = make_job(nodes=1, script="pass")
    with pytest.raises(InvalidJobError, match=r"worker-0.*this job has master-0"):
        run_local(job, tmp_path / "logs", quiet=True, faults=[Fault("worker-0", "x")])


# The Worker says "ready" and waits, but finishes on a restart.
POD_LOST = NODE_0_WAITS + """
    if (d / "worker-started").exists():
        (d / "done").touch()
        sys.exit(0)
    (d / "worker-started").touch()
    print("ready", flush=True)
    time.sleep(60)
"""


def test_a_killed_pod_is_restarted_under_restart_policy_exitcode(tmp_path):
    job = make_job(nodes=2, policy="ExitCode", script=POD_LOST.format(tmp=tmp_path))
    result = run_local(job, tmp_path / "logs", quiet=True, restart_delay_s=0,
                       faults=[Fault("worker-0", "^ready$", signal.SIGKILL)])
    assert result.restarts == 1 and result.exit_codes["master-0"] == 0
    assert len(result.faults) == 1 and result.faults[0].startswith("SIGKILL to every process of "
                                                                   "worker-0")
    log = (tmp_path / "logs" / "worker-0.log").read_text()
    assert "--- restart 1 (exit code 137, restartPolicy ExitCode" in log


@pytest.mark.distributed
@pytest.mark.slow
def test_the_built_in_trainers_job_names_the_rank_that_was_killed(tmp_path, micro_digits,
                                                                   resnet18_dir, capsys):
    """2 x 2 of the built-in trainer; rank 3 (worker-0's local rank 1) SIGKILLed mid-epoch, as
    the OOM killer does: the job's line names it, not a rank that lost it as a peer (exit 200)
    or one its launcher stopped. Never: the job fails at once, without the retry."""
    from kfvision.pipelines.cli import main

    job = tmp_path / "job.yaml"
    assert main(["job", "render", "--name", "oom", "--image", "local", "--model",
                 str(resnet18_dir), "--train", str(micro_digits["train"]), "--val",
                 str(micro_digits["val"]), "--out", str(tmp_path / "out"), "--nodes", "2",
                 "--procs-per-node", "2", *JOB_FLAGS, "--restart-policy", "Never",
                 "-o", str(job)]) == 0
    code = main(["job", "run-local", str(job), "--log-dir", str(tmp_path / "logs"),
                 "--fault", r"worker-0/1:KILL:epoch 1 \[2/"])
    out, err = capsys.readouterr()
    assert code == 1, err[-3000:]
    assert ("error: JobFailedError: job oom failed: rank 3 on node 1 exited with 137 (killed by "
            "SIGKILL: retried) after ") in err, err[-3000:]
    line = next(line for line in err.splitlines() if line.startswith("error: "))
    assert "the first failure of the job; following: rank " in line, line
    assert "[worker-0] [kfvision launch] FAILED: rank 3 on node 1 exited with 137" in out
    assert "lost a peer" in line  # node 0's ranks: exit 200, never taken for the cause
