"""The job that `kfvision job render`'s flags describe (and `tune render`'s, and a script job's):
the JobConfig of the flags, the manifest of `--kind`, and the canonical flags that give a
JobConfig back (the rendered YAML's header). The pipeline's train step makes its JobConfig from
its parameters instead (kfvision.pipelines.flow.steps.train.job_config)."""

from kfvision.pipelines.jobs.config import JobConfig
from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.kinds import KINDS as JOB_KINDS
from kfvision.trainer.options import options_of

JOB_OPTIONS = options_of(JobConfig)
# the job kind: PyTorchJob (Training Operator v1.9) or TrainJob (Kubeflow Trainer v2)
KINDS = tuple(sorted(k.lower() for k in JOB_KINDS))


def job_options_of(args) -> dict:
    """{option: value} of the JobConfig flags in `args` (repeatable ones as tuples)."""
    given = {o.name: getattr(args, o.name) for o in JOB_OPTIONS}
    given.update({o.name: tuple(given[o.name]) for o in JOB_OPTIONS if o.many})
    return given


def job_config_from_args(args) -> JobConfig:
    """The JobConfig of `kfvision job render`'s (and `tune render`'s) flags; the pipeline's is
    kfvision.pipelines.flow.steps.train.job_config."""
    from kfvision.trainer.config import config_from_args

    return JobConfig(train=config_from_args(args), **job_options_of(args))


def render_argv(cfg: JobConfig) -> list:
    """The canonical `kfvision job render` arguments that give `cfg` (for the YAML's header)."""
    from kfvision.pipelines.jobs.config import train_flags

    argv = ["--name", cfg.name, "--image", cfg.image]
    for opt in JOB_OPTIONS:
        value = getattr(cfg, opt.name)
        if not (opt.required or opt.many) and value != opt.default:
            argv += [opt.flag_name, str(value)]
    for opt in JOB_OPTIONS:
        if opt.many:
            argv += [a for item in getattr(cfg, opt.name) for a in (opt.flag_name,
                                                                    opt.show(item))]
    return argv + train_flags(cfg.train)


def build_job(args, cfg: JobConfig) -> tuple:
    """(job dict, the kind flags for the header) of `--kind`."""
    from kfvision.pipelines.jobs.kinds import PYTORCHJOB, named
    from kfvision.pipelines.jobs.render import render_job

    kind = named(args.kind)
    if kind is PYTORCHJOB:
        if args.runtime or args.runtime_kind:
            raise InvalidJobError("--runtime and --runtime-kind are for --kind trainjob; a "
                                  "PyTorchJob has no runtime. Drop them or add --kind trainjob.")
        return render_job(cfg, kind), []
    from kfvision.pipelines.jobs.trainjob.build import RuntimeRef

    runtime = RuntimeRef.from_flags(args.runtime, args.runtime_kind)
    argv = ["--kind", "trainjob", "--runtime", runtime.name]
    return render_job(cfg, kind, runtime), argv + (
        ["--runtime-kind", runtime.kind] if runtime.kind != RuntimeRef.kind else [])
