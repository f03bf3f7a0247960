"""A plain torchrun DDP script, as users bring it (nothing of kfvision in it):

    torchrun --nproc-per-node 2 train.py --data DIR --epochs 2 --lr 0.05

Trains a linear classifier on an image folder (class sub-folders), one shard per rank; rank 0
saves the model to $KFVISION_MODEL_DIR (or ./model) and a checkpoint per epoch.
"""

import argparse
import json
import os
import time

import inflection  # from requirements.txt: not in the image
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import datasets, transforms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--tag", default="")
    p.add_argument("--pause", type=float, default=0.0, help="seconds to wait between epochs")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    tf = transforms.Compose([transforms.Grayscale(), transforms.Resize((8, 8)),
                             transforms.ToTensor()])
    data = datasets.ImageFolder(args.data, transform=tf)
    sampler = torch.utils.data.distributed.DistributedSampler(data, world, rank, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, len(data.classes))))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    ckpt_dir = os.environ.get("KFVISION_CHECKPOINT_DIR", "checkpoints")
    ckpt, first = os.path.join(ckpt_dir, "last.pt"), 0
    if os.path.exists(ckpt):  # a restarted pod: go on from the last epoch
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        first = state["epoch"] + 1
        print(f"rank {rank} resumed from epoch {state['epoch']}", flush=True)
    for epoch in range(first, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        print(f"rank {rank}/{world} local_rank {os.environ['LOCAL_RANK']} epoch={epoch} "
              f"loss={loss.item():.4f}", flush=True)
        if epoch + 1 < args.epochs:
            time.sleep(args.pause)
    if rank == 0:
        out = os.environ.get("KFVISION_MODEL_DIR", "model")
        os.makedirs(out, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(out, "model.pt"))
        with open(os.path.join(out, "info.json"), "w") as f:
            json.dump({"classes": data.classes, "tag": inflection.underscore(args.tag),
                       "world_size": world}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
