"""A user's own training script, run unchanged as a PyTorchJob or TrainJob (docs/scripts.md):
snapshot (the reproducible source snapshot), manifest (ConfigMap + job), assemble (the job of the
command line's flags: packed, shipped, rendered), entry (checked against the snapshot), boot (the
pod side), reporter (node 0's progress reports), env (the requirements' cached environment),
outputs (the folders copied out), track (its MLflow run). The folders' variables are
pipelines/contract.py, a leaf the lower layers read too."""
