"""The PyTorchJob (`kubeflow.org/v1`, Kubeflow Training Operator v1.9): `build` (JobConfig -> the
manifest, pure), `rules` (the operator's names and what its webhook refuses), `local` (`kfvision
job run-local`: its replicas as local processes with the operator's environment)."""
