"""Which rank failed first (trainer/failures.py): the records' format, their order within a node
and across a job, and the stamps the launcher's ExitWatch takes (trainer/exitwatch.py) of real
processes."""

import os
import subprocess
import sys
import time

import pytest

from kfvision.trainer import failures
from kfvision.trainer.exitwatch import ExitWatch
from kfvision.trainer.failures import FAILED, LOST_PEER, STOPPED, ExitRecord, first_failure, order

T = 1_800_000_000.0  # a whole second: every time below falls within it or the next


def rec(rank, kind, at, node=None, code=None, nproc=2):
    node = rank // nproc if node is None else node
    code = code if code is not None else {FAILED: 1, LOST_PEER: 200, STOPPED: 143}[kind]
    return ExitRecord(rank, node, rank % nproc, 1000 + rank, kind, T + at, max(0.0, 10 + at), code)


def test_a_record_reads_back_from_its_line_whatever_comes_before_it():
    r = rec(3, FAILED, 0.123456)
    line = r.line()
    assert line == ("rank 3 (node 1, local rank 1, pid 1003) failed at "
                    "2027-01-15T08:00:00.123456+00:00, 10.12 s after the start: exited with 1 "
                    "(unexpected error: permanent)")
    for prefix in ("", "[1/-] [kfvision launch] ", "[worker-0] [1/-] [kfvision launch] ",
                   "2027-01-15T08:00:01.000000000Z [kfvision launch] "):
        back = failures.parse(prefix + line)
        assert back.at == pytest.approx(r.at, abs=1e-6)
        assert back == ExitRecord(3, 1, 1, 1003, FAILED, back.at, 10.12, 1)
    assert failures.parse("[1/3] rank 3 says hello at 12:00") is None


@pytest.mark.parametrize("records, first, following, stopped", [
    # within one second, the rank torchrun's tie-break (lowest rank) would name was stopped
    ([rec(3, FAILED, 0.40), rec(2, STOPPED, 0.45)], 3, [], [2]),
    ([rec(0, STOPPED, 0.95), rec(1, FAILED, 0.90)], 1, [], [0]),
    # across nodes: the peers on the other node fail from the broken collective after it
    ([rec(0, LOST_PEER, 0.72, code=1), rec(1, LOST_PEER, 0.61, code=1), rec(2, STOPPED, 0.52),
      rec(3, FAILED, 0.50)], 3, [1, 0], [2]),
    # the failing rank destroyed its process group before it exited: a peer ended first, but
    # from a lost peer; the cause is the one that failed by itself
    ([rec(0, LOST_PEER, 0.10), rec(3, FAILED, 0.30), rec(1, STOPPED, 0.31)], 3, [0], [1]),
    # two ranks failed by themselves (bad input everywhere): the earlier one, by microseconds
    ([rec(2, FAILED, 0.500002, code=2), rec(1, FAILED, 0.500001, code=2)], 1, [2], []),
    # a node lost whole: nobody failed by itself; the first to lose a peer is named
    ([rec(1, LOST_PEER, 0.8), rec(0, LOST_PEER, 0.7), rec(2, STOPPED, 0.2)], 0, [1], [2]),
    # the same microsecond on two nodes: still one answer, by node then rank
    ([rec(2, FAILED, 0.5), rec(1, FAILED, 0.5)], 1, [2], []),
])
def test_the_first_failure_is_the_earliest_that_failed_by_itself(records, first, following,
                                                                  stopped):
    for ordered in (records, records[::-1]):
        verdict = order(ordered)
        assert verdict.first.rank == first
        assert [r.rank for r in verdict.following] == following
        assert [r.rank for r in verdict.stopped] == stopped


def test_nothing_failed_when_every_rank_was_stopped():
    assert order([rec(0, STOPPED, 0.1), rec(1, STOPPED, 0.2)]) is None
    assert order([]) is None and first_failure(["[0/0] epoch 1 loss 0.3"]) is None


def test_the_summary_names_the_first_then_who_followed_and_who_was_stopped():
    verdict = order([rec(3, FAILED, 0.5), rec(2, STOPPED, 0.52), rec(1, LOST_PEER, 0.61),
                     rec(0, LOST_PEER, 1.25, code=1)])
    assert verdict.summary("the first failure of the job") == (
        "rank 3 on node 1 exited with 1 (unexpected error: permanent) after 10.5 s, the first "
        "failure of the job; following: rank 1 on node 0 (+0.11 s, lost a peer), rank 0 on "
        "node 0 (+0.75 s, lost a peer); stopped: rank 2 on node 1")
    lost = order([rec(1, LOST_PEER, 0.8)]).summary()
    assert lost == ("rank 1 on node 0 exited with 200 (lost a peer: retried) after 10.8 s, "
                    "having lost a peer")


def test_a_64_rank_summary_stays_one_readable_line():
    records = [rec(17, FAILED, 0.1, nproc=8)] + [
        rec(r, LOST_PEER if r // 8 != 2 else STOPPED, 0.2 + r / 1000, nproc=8)
        for r in range(64) if r != 17]
    text = order(records).summary()
    assert text.startswith("rank 17 on node 2 exited with 1")
    assert "and 48 more; stopped: " in text  # 56 followed, 7 were stopped
    assert text.count("rank ") == 1 + failures.LISTED + 7


def test_the_job_level_verdict_reads_every_pods_lines_of_this_attempt_only():
    retried = rec(3, FAILED, -30.0, code=137)  # an earlier attempt, killed and retried
    node1 = [f"[1/-] [kfvision launch] {r.line()}" for r in (retried, rec(3, FAILED, 0.5),
                                                              rec(2, STOPPED, 0.55))]
    node0 = ["[0/0] [rank0]: RuntimeError: Connection closed by peer",
             f"[0/-] [kfvision launch] {rec(0, LOST_PEER, 0.9, code=1).line()}",
             f"[0/-] [kfvision launch] {rec(1, STOPPED, 0.95).line()}"]
    assert first_failure(node0 + node1).first == retried  # without `since`: the old attempt
    verdict = first_failure(node0 + node1, since=T - 1)
    assert verdict.first.rank == 3 and verdict.first.code == 1
    assert [r.rank for r in verdict.following] == [0]
    assert [r.rank for r in verdict.stopped] == [2, 1]


@pytest.mark.parametrize("code, error, stopped, kind", [
    (1, "ValueError: rank 3 gives up", False, FAILED),
    (2, "InvalidDatasetError: class 7 is empty", False, FAILED),
    (200, None, False, LOST_PEER),  # the trainer's own code for it
    (1, "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed "
        "by peer [127.0.0.1]:33995", False, LOST_PEER),
    (1, "torch.distributed.DistBackendError: NCCL error in: ...", False, LOST_PEER),
    (1, "ConnectionResetError: [Errno 104] Connection reset by peer", False, LOST_PEER),
    (1, "RuntimeError: CUDA out of memory", False, FAILED),
    (1, "RuntimeError: DataLoader worker (pid 12) is killed by signal: Killed.", False, FAILED),
    (143, None, True, STOPPED),
    (1, "RuntimeError: Connection closed by peer", True, STOPPED),
])
def test_a_records_kind(code, error, stopped, kind):
    assert failures.kind_of(code, error, stopped) == kind


def test_the_error_is_the_tracebacks_last_line_with_its_prefixes_off():
    lines = ["[rank2]: Traceback (most recent call last):",
             '[rank2]:   File "/src/distributed_c10d.py", line 3913, in all_reduce',
             "[rank2]: ValueError: first",
             "[rank2]: During handling of the above exception, another exception occurred:",
             "[rank2]: RuntimeError: Connection closed by peer [127.0.0.1]:9934", "bye"]
    assert failures.error_of(lines) == "RuntimeError: Connection closed by peer [127.0.0.1]:9934"
    assert failures.error_of(["error: InvalidDatasetError: no images"]) == (
        "InvalidDatasetError: no images")
    assert failures.error_of(["KeyboardInterrupt"]) == "KeyboardInterrupt"
    assert failures.error_of(["all is well"]) is None


# --- the launcher's stamps, on real processes (no torch: ExitWatch needs none) ---

def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_the_watch_stamps_each_exit_as_it_happens_and_knows_who_was_stopped():
    watch, started = ExitWatch(), time.time()
    slow, quick = _child("import time; time.sleep(30)"), _child(
        "import sys, time; time.sleep(0.3); sys.exit(3)")
    watch.watch(1, [(2, 0, slow.pid, None, slow), (3, 1, quick.pid, None, quick)])
    os.waitid(os.P_PID, quick.pid, os.WEXITED | os.WNOWAIT)  # left for its parent to reap
    ended = time.time()
    time.sleep(0.2)  # then the launcher stops the other, as torchrun's agent does
    watch.stopping()
    slow.terminate()
    slow.wait()
    records = watch.records(started)
    watch.close()
    assert [(r.rank, r.node, r.local_rank, r.kind, r.code) for r in records] == [
        (3, 1, 1, FAILED, 3), (2, 1, 0, STOPPED, 143)]
    assert abs(records[0].at - ended) < 0.1  # when it ended, not the second it was noticed in
    assert records[1].at >= watch.stopping_at
    verdict = order(records)
    assert verdict.summary().startswith(
        "rank 3 on node 1 exited with 3 (non-finite loss: permanent) after 0.")


def test_the_watch_reads_a_scripts_last_error_from_torchruns_file_of_its_stderr(tmp_path):
    stderr = tmp_path / "stderr.log"
    stderr.write_text("[rank1]: Traceback (most recent call last):\n[rank1]: RuntimeError: "
                      "[gloo/transport/tcp/pair.cc:561] Connection closed by peer\n")
    watch = ExitWatch()
    proc = _child("import sys; sys.exit(1)")
    watch.watch(0, [(1, 1, proc.pid, str(stderr), proc)])
    proc.wait()
    (record,) = watch.records(time.time())
    watch.close()
    assert record.kind == LOST_PEER and record.code == 1
