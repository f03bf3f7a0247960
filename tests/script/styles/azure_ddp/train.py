"""An Azure ML v1 style DDP script, as the guide "Train PyTorch models at scale" configures it:

    --dist-backend gloo --dist-url $AZ_BATCHAI_PYTORCH_INIT_METHOD --rank $AZ_BATCHAI_TASK_INDEX
    --world-size N

It also writes the way torchvision's `pretrained=True` does (torch hub's cache under TORCH_HOME,
~/.cache/torch by default), tries the places a pod's read-only root refuses (--forbidden), and
prints to stdout and stderr in turn. Rank 0 reports what it saw in ./outputs/report.json.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dist-backend", default="gloo")
    p.add_argument("--dist-url", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--forbidden", nargs="*", default=[])
    p.add_argument("--literal", default="")
    args = p.parse_args()
    print(f"rank {args.rank} order 1 (stdout)", flush=True)
    print(f"rank {args.rank} order 2 (stderr)", file=sys.stderr, flush=True)
    print(f"rank {args.rank} order 3 (stdout)", flush=True)
    dist.init_process_group(args.dist_backend, init_method=args.dist_url, rank=args.rank,
                            world_size=args.world_size)
    total = torch.tensor([args.rank])
    dist.all_reduce(total)
    # what torch.hub.load_state_dict_from_url does before it downloads
    hub = os.path.join(torch.hub.get_dir(), "checkpoints")
    os.makedirs(hub, exist_ok=True)
    weights = os.path.join(hub, "resnet18-f37072fd.pth")
    torch.save({"w": torch.zeros(2)}, weights + f".{args.rank}.partial")
    os.replace(weights + f".{args.rank}.partial", weights)
    refused = {}
    for path in args.forbidden:
        try:
            with open(os.path.join(path, "probe.txt"), "w") as f:
                f.write("x")
            refused[path] = None
        except OSError as e:
            refused[path] = f"{type(e).__name__}: [Errno {e.errno}] {e.strerror}"
    if args.rank == 0:
        os.makedirs("outputs", exist_ok=True)
        with open("outputs/report.json", "w") as f:
            json.dump({"world": dist.get_world_size(), "rank_sum": int(total.item()),
                       "argv": sys.argv[1:], "home": os.environ["HOME"], "weights": weights,
                       "uid": os.getuid(), "refused": refused, "literal": args.literal}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
