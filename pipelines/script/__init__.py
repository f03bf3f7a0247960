"""A user's own training script, run unchanged as a PyTorchJob or TrainJob (docs/scripts.md):
pack (the reproducible source snapshot), job (ConfigMap + job), boot (the pod side), env (the
requirements' cached environment), contract (the folders' variables)."""
