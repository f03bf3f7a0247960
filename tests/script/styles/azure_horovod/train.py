"""An Azure ML v1 Horovod script, in the style of Azure's pytorch_horovod_mnist.py sample
(written for the test: a small convolutional net on a folder of digit images, no download), run
unchanged by kfvision: `Run.get_context()` and `horovod.torch` come from kfvision, since the
environment has neither azureml-core nor horovod.

    torchrun --nproc-per-node 2 train.py --epochs 3      (data: the `digits` input channel)

With --verify, every rank then runs checks.py (Horovod's semantics against torch.distributed)."""

import argparse
import os

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from azureml.core.run import Run
from torch import nn, optim
from torchvision import datasets, transforms


class Net(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, kernel_size=3)
        self.fc = nn.Linear(4 * 6 * 6, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc(x.flatten(1))


def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--verify", action="store_true")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed + hvd.rank())  # different on each rank: the broadcast fixes it
    run = Run.get_context()
    tf = transforms.Compose([transforms.Grayscale(), transforms.Resize((14, 14)),
                             transforms.ToTensor()])
    train_dataset = datasets.ImageFolder(run.input_datasets["digits"], transform=tf)
    sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                         sampler=sampler)
    model = Net(len(train_dataset.classes))
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.none)
    accuracies = []
    for epoch in range(args.epochs):
        model.train()
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            correct = sum((model(x).argmax(1) == y).sum().item() for x, y in loader)
        accuracy = metric_average(correct / len(sampler), "avg_accuracy")
        train_loss = metric_average(loss.item(), "avg_loss")
        accuracies.append(accuracy)
        if hvd.rank() == 0:
            run.log("epoch", epoch + 1)
            run.log(name="Training loss", value=train_loss, description="", step=epoch + 1)
            print(f"epoch {epoch + 1}: loss {train_loss:.4f} accuracy {accuracy:.3f}")
    if hvd.rank() == 0:
        run.log_list(name="accuracies", value=accuracies)
        run.tag("framework", "horovod")
        run.set_tags({"experiment": run.experiment.name})
        run.parent.log("final_accuracy", accuracies[-1])
        torch.save(model, "model.pt")  # the whole module, pickled, as Azure's samples save it
        run.upload_file(name="outputs/model.pt", path_or_stream="model.pt")
        model_obj = run.register_model(model_name="digits-hvd", model_path="outputs/model.pt",
                                       tags={"world": str(hvd.size())}, description="hvd")
        print(f"registered {model_obj.name} version {model_obj.version} as run {run.id}")
        run.complete()
    if args.verify:
        import checks

        checks.run_all(hvd, os.environ)
    hvd.shutdown()


if __name__ == "__main__":
    main()
