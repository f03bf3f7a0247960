"""A Training Operator-style script: one process per pod, reading MASTER_ADDR, MASTER_PORT, RANK
and WORLD_SIZE itself (as kubeflow/trainer v1.9.4's examples/pytorch/mnist does).

    python train.py --steps 3 [--exit-code N --fail-rank R]
"""

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--fail-rank", type=int, default=-1)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    url = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    print(f"rank {rank} of {world} via {url} argv {sys.argv[1:]}", flush=True)
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    if rank == args.fail_rank:  # once joined: the others' next collective fails at once
        sys.exit(args.exit_code)
    w = torch.zeros(4)
    if rank == 0:
        print(f"total_steps={args.steps}", flush=True)
    for step in range(args.steps):
        g = torch.full((4,), float(rank + step))
        dist.all_reduce(g)
        w -= 0.1 * g / world
        if rank == 0:
            print(f"step={step + 1} grad_norm={g.norm().item():.4f}", flush=True)
    print(f"rank {rank} done weights={w.tolist()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
