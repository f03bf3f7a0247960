"""The TrainJob (`trainer.kubeflow.org/v1alpha1`, Kubeflow Trainer v2): `build` (JobConfig -> the
manifest, and kfvision's runtime; pure), `rules` (the trainer's names and what its CRD and webhook
refuse), `local` (`kfvision job run-local`: its nodes as local processes with the torch plugin's
environment)."""
