"""Training as a Kubeflow PyTorchJob: render the manifest, run it locally, or run it on a cluster.

manifest: JobConfig -> PyTorchJob dict (pure); rules: the operator webhook's checks;
local: `kfvision job run-local`; cluster: submit/wait/logs/delete through the Kubernetes API;
the `kfvision job ...` command line is pipelines/cli/job.py.
"""
