"""The one place that dispatches on the job kind: a JobConfig into the manifest of a kind (running
kfvision's trainer, or another command such as a user's script's boot), and a manifest run on
this machine by its kind's local runner. What else differs between the kinds is a fact of
`JobKind` (pipelines/jobs/kinds.py)."""


from kfvision.pipelines.jobs.config import JobConfig


def render_job(cfg: JobConfig, kind, runtime=None) -> dict:
    """The job of `kind` (a JobKind) for `cfg`; a TrainJob references `runtime` (a RuntimeRef,
    or the name of a ClusterTrainingRuntime; None: kfvision's)."""
    from kfvision.pipelines.jobs.kinds import TRAINJOB

    if kind is TRAINJOB:
        from kfvision.pipelines.jobs.trainjob.build import RuntimeRef, build_trainjob

        ref = runtime if isinstance(runtime, RuntimeRef) else RuntimeRef(runtime or RuntimeRef.name)
        return build_trainjob(cfg, ref.validate())
    from kfvision.pipelines.jobs.pytorchjob.build import build_pytorchjob

    return build_pytorchjob(cfg)


def render_command_job(cfg: JobConfig, kind, runtime, command, args, *, volumes=(), mounts=(),
                       annotations=None) -> dict:
    """As render_job, with the training container running `command` `args` instead of the
    trainer, `volumes` added to the pods and `mounts` to that container, `annotations` on the
    job; validated once complete.

    Raises:
        InvalidJobError: the job breaks a rule of its kind.
    """
    from kfvision.pipelines.jobs.kinds import TRAINJOB

    job = render_job(cfg, kind, runtime)
    if kind is TRAINJOB:
        from kfvision.pipelines.jobs.trainjob.build import set_command
        from kfvision.pipelines.jobs.trainjob.rules import validate_trainjob as validate
    else:
        from kfvision.pipelines.jobs.pytorchjob.build import set_command
        from kfvision.pipelines.jobs.pytorchjob.rules import validate_pytorchjob as validate
    job = set_command(job, command, args, volumes, mounts)
    if annotations:
        job["metadata"]["annotations"] = dict(annotations)
    return validate(job, f"the rendered job {cfg.name!r}")


def run_local(job: dict, log_dir, *, grace_s: float | None = None, **options):
    """Run the manifest `job` on this machine with its kind's local runner (pipelines/jobs/
    pytorchjob/local.py or trainjob/local.py), `options` as both take them; `grace_s` (how long
    Workers may finish once the Master succeeded) is a PyTorchJob's: a TrainJob ends when every
    node has succeeded. Where it stands is recorded in LOG_DIR/status.json as it runs
    (pipelines/jobs/localstatus.py: `kfvision job status`). Returns the runner's LocalResult."""
    from kfvision.pipelines.jobs.kinds import TRAINJOB, kind_of
    from kfvision.pipelines.jobs.localstatus import Record

    if kind_of(job) is TRAINJOB:
        from kfvision.pipelines.jobs.trainjob.local import run_local as runner
    else:
        from kfvision.pipelines.jobs.pytorchjob.local import run_local as runner

        if grace_s is not None:
            options["grace_s"] = grace_s
    with Record(job, log_dir) as record:
        result = runner(job, log_dir, on_line=record, **options)
        record.succeeded(result)
    return result
