"""A Hugging Face Accelerate script as users bring it (nothing of kfvision in it): a tiny model
built in code (no hub), `Accelerator().prepare(...)`, `accelerator.backward`, started by
torchrun, whose variables Accelerate reads:

    torchrun --nnodes 2 --nproc-per-node 2 train.py --data DIR --epochs 2

The main process prints the total once and `step=N loss=...` every few steps, `epoch=E ...`
after each epoch, through `accelerator.print` (the lines kfvision reads); the weights go to
$KFVISION_MODEL_DIR (or ./model).
"""

import argparse
import os

import torch
from accelerate import Accelerator
from torchvision import datasets, transforms


class TinyNet(torch.nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32),
                                        torch.nn.ReLU(), torch.nn.Linear(32, classes))

    def forward(self, x):
        return self.body(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=1)
    args = p.parse_args()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    tf = transforms.Compose([transforms.Grayscale(), transforms.Resize((8, 8)),
                             transforms.ToTensor()])
    data = datasets.ImageFolder(args.data, transform=tf)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model = TinyNet(len(data.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.print(f"total_steps={args.epochs * len(loader)} "
                      f"processes={accelerator.num_processes}")
    step = 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.log_every == 0:
                accelerator.print(f"step={step} loss={loss.item():.4f}")
        accelerator.print(f"epoch={epoch} step={step} epoch_loss={loss.item():.4f}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        out = os.environ.get("KFVISION_MODEL_DIR", "model")
        os.makedirs(out, exist_ok=True)
        accelerator.save(accelerator.unwrap_model(model).state_dict(),
                         os.path.join(out, "model.pt"))


if __name__ == "__main__":
    main()
