"""What rank 0 reports after every validation besides the human log: one `name=value` line that
Katib's StdOut metrics collector parses, and (with `--tensorboard DIR`) TensorBoard event files with
the same scalars, which Katib's TensorFlowEvent collector and Kubeflow's TensorBoard read.

    epoch=3 train-loss=0.412 validation-loss=0.233 validation-top1=0.951 validation-top5=0.998

Katib's default StdOut filter is `([\\w|-]+)\\s*=\\s*([+-]?\\d*(\\.\\d+)?([Ee][+-]?\\d+)?)`: names
of word characters and '-', plain or exponent numbers (`%g` writes nothing else for finite values).
Torch-free at import: the tuning front ends take the metric names from here.
"""

import logging
import math
from pathlib import Path

log = logging.getLogger("trainer")

# metric name (in the line, in TensorBoard, in a Katib Experiment) -> key of a history record
METRICS = {"epoch": "epoch", "train-loss": "train_loss", "train-top1": "train_top1",
           "validation-loss": "val_loss", "validation-top1": "val_top1",
           "validation-top5": "val_top5", "lr": "lr"}
# what a search may optimise, and in which direction
OBJECTIVES = {"validation-loss": "minimize", "validation-top1": "maximize",
              "validation-top5": "maximize"}


def metric_line(record: dict) -> str:
    """The `name=value ...` line of one epoch's history record (non-finite values left out: the
    collector's regex would read `nan` as no number)."""
    pairs = []
    for name, key in METRICS.items():
        value = record[key]
        if isinstance(value, int):
            pairs.append(f"{name}={value}")
        elif math.isfinite(value):
            pairs.append(f"{name}={value:.6g}")
    return " ".join(pairs)


class EpochReporter:
    """Reports each new epoch of the history once (rank 0 only; a resumed run reports the epochs
    of its checkpoint again, which both collectors take as the same values)."""

    def __init__(self, tensorboard: str | None = None):
        self.tensorboard, self.writer, self.reported = tensorboard, None, 0

    def __call__(self, history: list) -> None:
        for record in history[self.reported:]:
            log.info("%s", metric_line(record))
            if self.tensorboard:
                self._scalars(record)
        self.reported = len(history)

    def _scalars(self, record: dict) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            Path(self.tensorboard).mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=self.tensorboard)
        for name, key in METRICS.items():
            if name != "epoch":
                self.writer.add_scalar(name, record[key], global_step=record["epoch"])
        self.writer.add_scalar("train-images-per-sec", record["train_images_per_sec"],
                               global_step=record["epoch"])
        self.writer.flush()  # a killed run keeps what it reported

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
