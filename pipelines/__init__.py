"""kfvision pipelines: the kfvision command line, KFP components, the
PyTorchJob and TrainJob builders and runners."""
