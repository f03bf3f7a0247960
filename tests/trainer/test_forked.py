"""The launcher forks the built-in trainer's processes where it may (trainer/forked.py): which
programs are forked, what torchrun is told, and how another process finds a forked process's
local rank. The forked processes' training, failures, signals and logs are the jobs' own tests
(tests/jobs/: every built-in job there runs forked on this machine)."""

import os
import signal
import subprocess
import sys
import time

import pytest
from torch.distributed import run as torchrun

from kfvision.trainer import forked


def _args(*argv):
    return torchrun.parse_args(["--standalone", "--nproc-per-node", "2", *argv])


@pytest.mark.parametrize("argv, forks", [
    (["-m", "kfvision.trainer.train", "--epochs", "1"], True),
    (["train.py", "--epochs", "1"], False),  # a user's script: exec'd, as torchrun does
    (["-m", "mypkg.train"], False),
    (["--no-python", "kfvision-train"], False),
    (["--run-path", "train.py"], False),
])
def test_only_the_built_in_trainer_is_forked(argv, forks, monkeypatch):
    monkeypatch.setattr(forked, "accelerator_devices", lambda: False)
    assert forked.forks(_args(*argv)) is forks


def test_nothing_is_forked_where_a_gpu_device_is_present(tmp_path, monkeypatch):
    assert not forked.accelerator_devices(tmp_path)
    (tmp_path / "nvidiactl").touch()  # the driver's control device alone is no GPU
    assert not forked.accelerator_devices(tmp_path)
    (tmp_path / "nvidia0").touch()
    assert forked.accelerator_devices(tmp_path)
    (tmp_path / "nvidia0").unlink()
    (tmp_path / "kfd").touch()  # ROCm
    assert forked.accelerator_devices(tmp_path)


def test_torchrun_is_told_to_fork_the_trainers_main_with_the_training_flags():
    args = _args("-m", "kfvision.trainer.train", "--epochs", "1", "--lr", "0.1")
    before = torchrun.config_from_args(args)
    with forked.forking(torchrun):
        config, entrypoint, entry_args = torchrun.config_from_args(args)
    assert (config.start_method, entrypoint, entry_args) == (
        "fork", forked.train, ["--epochs", "1", "--lr", "0.1"])
    assert torchrun.config_from_args(args)[1:] == before[1:]  # as it was, after the block
    assert before[0].start_method == "spawn" and before[1] != forked.train


# A process that forks a child named as a forked training process of local rank 3 and prints the
# child's pid. Forked there, not in the pytest worker: a fork of the worker (threads, xdist's
# channel) once ended the worker ("node down: Not properly terminated").
FORKS_A_RANK = """
import os, time
from kfvision.trainer import forked
pid = os.fork()
if pid == 0:
    try:
        forked.name_process(forked.RANK_NAME.format(3))
        time.sleep(30)
    finally:
        os._exit(0)
print(pid, flush=True)
os.waitpid(pid, 0)
"""


def _seen_rank(pid: int):
    """local_rank_of(pid) once it says one (a process just started may not have its name or
    environment yet), or None after 10 s."""
    deadline = time.monotonic() + 10
    while forked.local_rank_of(pid) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return forked.local_rank_of(pid)


def test_a_forked_process_is_found_by_its_name_an_execd_one_by_its_environment():
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    parent = subprocess.Popen([sys.executable, "-c", FORKS_A_RANK], env=env,
                              stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    try:
        assert _seen_rank(pid) == 3
    finally:
        os.kill(pid, signal.SIGKILL)
        parent.wait(timeout=30)
        parent.stdout.close()
    execd = subprocess.Popen(["sleep", "30"], env={**os.environ, "LOCAL_RANK": "2"})
    try:  # Popen may return before exec has set the new environment up (/proc reads it empty)
        assert _seen_rank(execd.pid) == 2
    finally:
        execd.kill()
        execd.wait()
    assert forked.local_rank_of(os.getpid()) is None  # pytest's own: neither says
    assert forked.local_rank_of(2 ** 22 + 1) is None  # no such process


def test_a_forked_process_gets_back_the_signal_handlers_torchrun_took(monkeypatch):
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    wanted = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    before = {s: signal.getsignal(s) for s in wanted}
    monkeypatch.delenv(forked.TORCHELASTIC_SIGNALS, raising=False)
    try:
        for s in wanted:  # as torchrun's agent leaves them in the launcher
            signal.signal(s, _terminate_process_handler)
        forked._default_signals()
        assert {s: signal.getsignal(s) for s in wanted} == {
            signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler,
            signal.SIGHUP: signal.SIG_DFL, signal.SIGQUIT: signal.SIG_DFL}
    finally:
        for s, h in before.items():
            signal.signal(s, h)
