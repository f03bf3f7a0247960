"""kfvision's bridge for Horovod scripts: `horovod.torch` on torch.distributed (see
kfvision.pipelines.script.hvd). Only `horovod.torch` is provided."""

__version__ = "0.28.1"  # the API it follows
