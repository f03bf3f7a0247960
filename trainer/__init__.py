"""kfvision trainer core: image directories, models, the DDP training loop, scoring."""
