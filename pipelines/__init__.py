"""kfvision pipelines: the kfvision command line, KFP components, PyTorchJob builder and runners."""
