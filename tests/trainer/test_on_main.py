"""on_main, the one way to do rank-0-only work: rank 0's failure reaches every rank (no rank is
left waiting in a collective, and the next collective meets), with two real gloo processes."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kfvision.trainer.distributed import DistContext, on_main
from kfvision.trainer.errors import OutputError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

FAILURES = {"none": None, "named": OutputError("the volume is full"), "other": ValueError("bug")}


def _rank(rank: int, port: int, results) -> None:
    """Every case in turn, in one process group: a failure leaves no rank in a collective, so
    the next case's collective still meets (two processes started once, not once a case)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ctx = DistContext(rank, rank, 2, 2, torch.device("cpu"))
    try:
        for failure, raised in FAILURES.items():
            def work(raised=raised):
                if raised is not None:
                    raise raised
                return "written"

            try:
                results[(failure, rank)] = f"returned {on_main(ctx, work)}"
            except Exception as e:  # noqa: BLE001 - what each rank saw is the result
                results[(failure, rank)] = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()


def test_rank_0s_work_and_its_failure_reach_every_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(port, results), nprocs=2, join=True)
    seen = {failure: (results[(failure, 0)], results[(failure, 1)]) for failure in FAILURES}
    assert seen == {
        "none": ("returned written", "returned None"),
        "named": ("OutputError: the volume is full", "OutputError: the volume is full"),
        "other": ("ValueError: bug", "RuntimeError: rank 0 failed: ValueError: bug"),
    }
