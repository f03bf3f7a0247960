"""The baseline: the training loop people write by hand (and torchvision's tutorials teach).

torchvision.datasets.ImageFolder + PIL transforms + DataLoader + eager fp32 SGD, no tricks.
It trains the same model with the same augmentation, batch size and optimiser settings as
`kfvision train`, and prints one JSON line: {"images_per_sec": [...], "epoch_seconds": [...]},
one figure per epoch.

    python -m bench.plain_loop --data DIR --arch resnet18 --image-size 32 --batch-size 32 \
        --epochs 3 --workers 2
"""

import argparse
import json
import time

import torch
import torchvision
from torch import nn
from torchvision import transforms


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="folder of class folders")
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--augment", choices=("standard", "light"), default="standard")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    s = args.image_size
    crop = (transforms.RandomResizedCrop(s) if args.augment == "standard" else
            transforms.RandomResizedCrop(s, scale=(0.7, 1.0), ratio=(0.85, 1.18)))
    aug = [crop, transforms.RandomHorizontalFlip()] if args.augment == "standard" else [crop]
    tf = transforms.Compose([*aug, transforms.ToTensor(),
                             transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = torchvision.datasets.ImageFolder(args.data, transform=tf)
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True,
                                         num_workers=args.workers,
                                         persistent_workers=args.workers > 0)
    dev = torch.device(args.device)
    model = torchvision.models.get_model(args.arch, num_classes=len(ds.classes)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    rates, seconds = [], []
    for _ in range(args.epochs):
        model.train()
        start, n = time.perf_counter(), 0
        for x, y in loader:
            x, y = x.to(dev), y.to(dev)
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            n += len(y)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        rates.append(n / seconds[-1])
    print(json.dumps({"images_per_sec": rates, "epoch_seconds": seconds}))


if __name__ == "__main__":
    main()
