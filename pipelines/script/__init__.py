"""A user's own training script, run unchanged as a PyTorchJob or TrainJob (docs/scripts.md):
pack (the reproducible source snapshot), job (ConfigMap + job), entry (checked against the
snapshot), boot (the pod side), env (the requirements' cached environment), outputs (the folders
copied out), track (its MLflow run). The folders' variables are pipelines/contract.py, a leaf
the lower layers read too."""
