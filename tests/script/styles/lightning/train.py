"""A PyTorch Lightning script as users bring it (nothing of kfvision in it): a LightningModule,
its DataLoaders and `Trainer(strategy="ddp")`, started by torchrun, whose variables Lightning
reads (its TorchElasticEnvironment):

    torchrun --nnodes 2 --nproc-per-node 2 train.py --data DIR --val DIR --epochs 2

Global rank 0 prints the total once and, after every validation, the epoch and the logged
metrics as `name=value` (the lines kfvision reads: its progress and MLflow curves); the last
checkpoint goes to $KFVISION_MODEL_DIR (or ./model).
"""

import argparse
import os

import lightning as L
import torch
from torchvision import datasets, transforms


class Classifier(L.LightningModule):
    def __init__(self, classes: int, lr: float):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, classes))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, on_step=False, sync_dist=True)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        accuracy = (self.net(x).argmax(1) == y).float().mean()
        self.log("val_acc", accuracy, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class PrintMetrics(L.Callback):
    """What a user adds to see the numbers in the log: one line per epoch, from rank 0."""

    def on_train_start(self, trainer, module):
        if trainer.is_global_zero:
            print(f"max_epochs={trainer.max_epochs}", flush=True)

    def on_train_epoch_end(self, trainer, module):
        if trainer.is_global_zero:
            shown = " ".join(f"{k}={v:.4f}" for k, v in trainer.callback_metrics.items())
            print(f"epoch={trainer.current_epoch} {shown}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()
    L.seed_everything(0, verbose=False)
    tf = transforms.Compose([transforms.Grayscale(), transforms.Resize((8, 8)),
                             transforms.ToTensor()])
    train = datasets.ImageFolder(args.data, transform=tf)
    val = datasets.ImageFolder(args.val, transform=tf)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = L.Trainer(accelerator="cpu", devices=per_node, strategy="ddp",
                        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // per_node,
                        max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[PrintMetrics()])
    model = Classifier(len(train.classes), args.lr)
    trainer.fit(model, torch.utils.data.DataLoader(train, batch_size=8, shuffle=True),
                torch.utils.data.DataLoader(val, batch_size=8))
    out = os.environ.get("KFVISION_MODEL_DIR", "model")
    trainer.save_checkpoint(os.path.join(out, "last.ckpt"))  # written by global rank 0


if __name__ == "__main__":
    main()
