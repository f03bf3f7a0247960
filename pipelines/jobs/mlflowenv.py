"""The MLflow variables a training job's container gets: one rule for the pipeline's train step
(pipelines/flow/steps/train.py, trainscript.py) and `kfvision job render --source`
(pipelines/script/assemble.py), so that both forward the same names and keep credentials out of
a manifest alike (docs/tracking.md)."""

import sys


def tracking_env(environ, *, kind: str, name: str, run_id: str, local: bool, out=None) -> tuple:
    """((name, value), ...) for the job's training container: the MLflow variables this step
    received (KFP 2.17 injects them where MLflow is configured: the task's nested run, so the
    job's curves land in the run the KFP UI links to) and the job's kind, name and pipeline run as
    the run's tags. Nothing without MLFLOW_TRACKING_URI. Credentials go only into local
    processes: on a cluster they would stand in the manifest in clear text (docs/tracking.md)."""
    from kfvision.trainer import upstream
    from kfvision.trainer.tracking import JOB_TAGS

    if not environ.get(upstream.MLFLOW_TRACKING_URI):
        return ()
    names = upstream.MLFLOW_FORWARDED + (upstream.MLFLOW_CREDENTIALS if local else ())
    env = [(n, environ[n]) for n in names if environ.get(n)]
    held = [n for n in upstream.MLFLOW_CREDENTIALS if environ.get(n) and not local]
    if held:
        print(f"MLflow: {', '.join(held)} not written into the job (it would stand in the "
              "manifest in clear text); give the job's pods a Secret or use "
              "MLFLOW_TRACKING_AUTH (docs/tracking.md)", file=out or sys.stdout, flush=True)
    tags = dict(zip(JOB_TAGS, (kind, name, run_id), strict=True))
    return (*env, *((k, v) for k, v in tags.items() if v))
