"""A SageMaker-style script: hyperparameters as arguments, data from SM_CHANNEL_TRAIN, the model
to SM_MODEL_DIR, other results to SM_OUTPUT_DATA_DIR (as the SageMaker PyTorch estimator runs
it: `python train.py --epochs 2 --lr 0.1`). The model is saved as TorchScript with its class
names and input settings, the layout kfvision scores and serves (docs/scripts.md).
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
    size, mean, std = 16, [0.5] * 3, [0.5] * 3
    tf = transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor(),
                             transforms.Normalize(mean, std)])
    data = datasets.ImageFolder(args.train, transform=tf)
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Flatten(),
                                torch.nn.Linear(3 * size * size, len(data.classes)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    print(f"epochs={args.epochs}", flush=True)
    for epoch in range(args.epochs):
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        print(f"epoch={epoch} loss={loss.item():.4f}", flush=True)
    torch.jit.save(torch.jit.script(model.eval()), os.path.join(args.model_dir, "model.pt"))
    with open(os.path.join(args.model_dir, "classes.txt"), "w") as f:
        f.write("\n".join(data.classes) + "\n")
    with open(os.path.join(args.model_dir, "kfvision.json"), "w") as f:
        json.dump({"image_size": size, "mean": mean, "std": std, "eval_preset": "none"}, f)
    with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], "metrics.json"), "w") as f:
        json.dump({"loss": loss.item(), "hosts": json.loads(os.environ["SM_HOSTS"]),
                   "current_host": os.environ["SM_CURRENT_HOST"],
                   "channels": json.loads(os.environ["SM_CHANNELS"])}, f)
