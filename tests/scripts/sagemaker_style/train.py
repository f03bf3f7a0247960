"""A SageMaker-style script: hyperparameters as arguments, data from SM_CHANNEL_TRAIN, the model
to SM_MODEL_DIR, other results to SM_OUTPUT_DATA_DIR (as the SageMaker PyTorch estimator runs
it: `python train.py --epochs 2 --lr 0.1`).
"""

import argparse
import json
import os

import torch
from torchvision import datasets, transforms

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--model-dir", default=os.environ["SM_MODEL_DIR"])
    p.add_argument("--train", default=os.environ["SM_CHANNEL_TRAIN"])
    p.add_argument("--num-gpus", type=int, default=int(os.environ["SM_NUM_GPUS"]))
    args = p.parse_args()
    tf = transforms.Compose([transforms.Grayscale(), transforms.Resize((8, 8)),
                             transforms.ToTensor()])
    data = datasets.ImageFolder(args.train, transform=tf)
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, len(data.classes)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        print(f"epoch={epoch} loss={loss.item():.4f}", flush=True)
    torch.save(model.state_dict(), os.path.join(args.model_dir, "model.pt"))
    with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], "metrics.json"), "w") as f:
        json.dump({"loss": loss.item(), "hosts": json.loads(os.environ["SM_HOSTS"]),
                   "current_host": os.environ["SM_CURRENT_HOST"],
                   "channels": json.loads(os.environ["SM_CHANNELS"])}, f)
