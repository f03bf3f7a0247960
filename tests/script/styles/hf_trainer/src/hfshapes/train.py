"""A Hugging Face Trainer script as the Transformers docs teach it (nothing of kfvision in it): a
tiny ViT built from a config (no hub), a dataset made in code, `Trainer(...).train()`, the model
saved to `--output_dir` beside the script. Installed as a console script:

    pip install -e . && torchrun --nproc-per-node 2 $(which train-shapes) --epochs 3
"""

import argparse

import torch
from transformers import Trainer, TrainingArguments, ViTConfig, ViTForImageClassification


class Shapes(torch.utils.data.Dataset):
    """16x16 noise with a bright square top-left (label 0) or bottom-right (label 1)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.noise = torch.rand(n, 3, 16, 16, generator=g) * 0.2

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x, y = self.noise[i].clone(), int(self.labels[i])
        if y == 0:
            x[:, :8, :8] += 1.0
        else:
            x[:, 8:, 8:] += 1.0
        return {"pixel_values": x, "labels": y}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", default="vit-tiny-shapes")
    p.add_argument("--epochs", type=float, default=3)
    args = p.parse_args()
    config = ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32,
                       num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                       num_labels=2)
    model = ViTForImageClassification(config)
    training = TrainingArguments(output_dir=args.output_dir, num_train_epochs=args.epochs,
                                 per_device_train_batch_size=8, learning_rate=5e-4,
                                 logging_steps=1, save_strategy="no", report_to="none",
                                 log_level="info", seed=0)
    trainer = Trainer(model=model, args=training, train_dataset=Shapes(96, 0))
    trainer.train()
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
