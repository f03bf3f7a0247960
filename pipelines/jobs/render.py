"""The one place that turns a JobConfig into the manifest of a job kind."""


from pipelines.jobs.config import JobConfig


def render_job(cfg: JobConfig, kind, runtime: str) -> dict:
    """The job of `kind` (a JobKind) for `cfg`; a TrainJob references the ClusterTrainingRuntime
    `runtime`."""
    from pipelines.jobs.kinds import TRAINJOB

    if kind is TRAINJOB:
        from pipelines.jobs.trainjob.build import RuntimeRef, build_trainjob

        return build_trainjob(cfg, RuntimeRef(runtime).validate())
    from pipelines.jobs.pytorchjob.build import build_pytorchjob

    return build_pytorchjob(cfg)
