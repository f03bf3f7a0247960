"""Training as a Kubeflow job: render the manifest, run it locally, or run it on a cluster.

Two kinds, laid out alike: `pytorchjob/` (Training Operator v1.9) and `trainjob/` (Kubeflow
Trainer v2), each with `build` (JobConfig -> manifest, pure), `rules` (what the kind's CRD and
webhook refuse, and the platform's names) and `local` (`kfvision job run-local`). Shared:
`config` (JobConfig, its options and checks, the pod both kinds run), `kinds` (what differs between
the kinds for the runners, reading a manifest of either, which kind a cluster serves), `procs` and
`faults` (local processes, fault drills), `jobclient` (+ `podstatus`: submit/wait/logs/delete
through pipelines/clients/k8s.py), `fromflags` (the JobConfig and manifest of `job render`'s
flags), `mlflowenv` (the MLflow variables a job's container gets). The `kfvision job ...` command
line is pipelines/cli/job.py.
"""
