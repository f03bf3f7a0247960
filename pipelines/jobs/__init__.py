"""Training as a Kubeflow job: render the manifest, run it locally, or run it on a cluster.

Two kinds: PyTorchJob (Training Operator v1.9) and TrainJob (Kubeflow Trainer v2).
manifest / trainjob: JobConfig -> PyTorchJob / TrainJob dict, and kfvision's runtime (pure);
rules / trainjob_rules: what each kind's CRD and webhook refuse; kinds: what differs between the
kinds, reading a manifest of either, API discovery; local / local_trainjob: `kfvision job
run-local`; cluster (+ podstatus): submit/wait/logs/delete through the Kubernetes API; the
`kfvision job ...` command line is pipelines/cli/job.py.
"""
