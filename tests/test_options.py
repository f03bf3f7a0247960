"""The option tables (TrainConfig's, JobConfig's and PipelineInputs' fields) against everything
that must repeat them literally (KFP's pipeline and component signatures), the names each front
end gives an option in its errors, and every --help of the command line."""

import argparse
import inspect
from dataclasses import MISSING

import pytest
from helpers.parsers import every_parser

from kfvision.pipelines.flow import components
from kfvision.pipelines.flow.params import (
    JOB_OPTIONS,
    TRAIN_OPTIONS,
    PipelineInputs,
    parameter_name,
)
from kfvision.pipelines.flow.params import pipeline_options as pipeline_table
from kfvision.pipelines.flow.pipeline import image_classification, parameter_defaults
from kfvision.pipelines.jobs.config import JobConfig, Toleration
from kfvision.trainer.config import TrainConfig
from kfvision.trainer.errors import InvalidParameterError
from kfvision.trainer.options import options_of

PIPELINE = inspect.signature(image_classification.pipeline_func).parameters
TABLE = pipeline_table()
COMPONENTS = {name: getattr(components, name) for name in (
    "check_parameters", "convert_to_image_directory", "split_image_directory", "resnet",
    "densenet", "train_pytorch_model", "score_image_model", "evaluate_model", "deploy_model")}
# A component's own default that is meant to differ from the pipeline's.
OWN_DEFAULTS = {("densenet", "model_name")}


def test_every_pipeline_parameter_is_an_option_and_every_option_a_parameter():
    assert sorted(PIPELINE) == sorted(TABLE)


@pytest.mark.parametrize("name", list(PIPELINE))
def test_the_pipeline_signature_matches_the_tables(name):
    param, opt = PIPELINE[name], TABLE[name]
    assert param.annotation is opt.type
    if opt.required:  # the pipeline may give one (image) or not (train_source)
        return
    assert param.default == opt.param_default
    assert type(param.default) is type(opt.param_default)


@pytest.mark.parametrize("opt", TRAIN_OPTIONS, ids=lambda o: o.name)
def test_the_pipelines_training_defaults_are_train_configs(opt):
    """A default of None (the recipe's) is KFP's '' or 0, which the step reads back as None."""
    field = TrainConfig.__dataclass_fields__[opt.name]
    assert opt.from_param(parameter_defaults()[opt.param]) == field.default


@pytest.mark.parametrize("component", list(COMPONENTS))
def test_component_signatures_match_the_pipelines_parameters(component):
    params = inspect.signature(COMPONENTS[component].python_func).parameters
    for name, param in params.items():
        if name not in PIPELINE:
            continue  # artifacts, run_id, task_name, source, ...
        assert param.annotation is PIPELINE[name].annotation, name
        if param.default is not inspect.Parameter.empty and (component,
                                                             name) not in OWN_DEFAULTS:
            assert param.default == PIPELINE[name].default, name


def test_the_train_and_check_components_take_every_option_they_hand_on():
    train = inspect.signature(components.train_pytorch_model.python_func).parameters
    check = inspect.signature(components.check_parameters.python_func).parameters
    needed = {o.param for o in (*TRAIN_OPTIONS, *JOB_OPTIONS)} | {"pvc_name", "execution_mode"}
    assert needed <= set(train)
    every = set(TABLE) - {"pretrained", "zero_init_residual", "memory_efficient"}
    # and the compile-time store (`--data-uri`, flow/storage.py), an input rather than an option
    assert set(check) == every | {"store"}


def test_each_name_is_one_option():
    tables = [options_of(c) for c in (TrainConfig, JobConfig, PipelineInputs)]
    names = [o.name for t in tables for o in t]
    flags = [f for t in tables[:2] for o in t for f in o.flags]  # aliases too
    params = [o.param for t in tables for o in t if o.param]
    for listed in (names, flags, params):
        assert len(listed) == len(set(listed))


def _train(**over):
    return TrainConfig("m", "t", "v", "o", **over).validate()


def _job(**over):
    return JobConfig(name="d", image="i", train=TrainConfig("m", "t", "v", "o"),
                     **over).validate()


@pytest.mark.parametrize("make, field, flag, parameter", [
    (lambda: _train(lr=0.0), "lr", "0 < --lr <= 10", "0 < learning_rate <= 10"),
    (lambda: _train(print_freq=0), "print_freq", "1 <= --print-freq", "1 <= print_frequency"),
    (lambda: _train(warmup_epochs=6), "warmup_epochs", "--warmup-epochs <= 5 (5: --epochs)",
     "warmup_epochs <= 5 (5: epochs)"),
    (lambda: _train(amp="fp16"), "amp", "--amp = 'fp16' is not valid", "amp = 'fp16'"),
    (lambda: _job(shm_size="big"), "shm_size", "--shm-size 'big'", "shm_size 'big'"),
    (lambda: _job(cpu="lots"), "cpu", "--cpu 'lots'", "cpu_per_node 'lots'"),
    (lambda: _job(active_deadline=0), "active_deadline", "1 <= --active-deadline",
     "1 <= timeout_seconds"),
    (lambda: _job(tolerations=(Toleration("gpu", None, "NoRun"),)), "tolerations",
     "--toleration gpu: effect 'NoRun'", "tolerations gpu: effect 'NoRun'"),
    (lambda: _job(gpus_per_node=1, procs_per_node=2), "procs_per_node",
     "--nproc-per-node 2 is more than --gpus-per-node 1", "procs_per_node 2 is more than "
     "gpus_per_node 1"),
])
def test_errors_carry_the_field_and_each_front_end_names_it(make, field, flag, parameter):
    with pytest.raises(InvalidParameterError) as e:
        make()
    assert e.value.field == field
    assert flag in str(e.value)  # the command line
    assert parameter in e.value.named(parameter_name)  # the pipeline's step log


def _parsers():
    """(command, parser) of every command and sub-command of `kfvision`, and the trainer's."""
    return [("python -m kfvision.trainer.train" if words is None else " ".join(words) or "kfvision",
             parser)
            for words, parser in every_parser()]


def _default_shown(action) -> bool:
    """Whether a flag has a default worth showing in its help."""
    default = action.default
    return default not in (None, "", [], (), MISSING, argparse.SUPPRESS) and not action.required


PARSERS = _parsers()


@pytest.mark.parametrize("command, parser", PARSERS, ids=[c for c, _ in PARSERS])
def test_no_help_repeats_a_default_or_hides_a_real_one(command, parser):
    tables = {o.name: o for c in (TrainConfig, JobConfig) for o in options_of(c)}
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.help in (None, argparse.SUPPRESS):
            continue
        text = " ".join(formatter._expand_help(action).split())
        where = f"kfvision {command} {action.option_strings[-1]}: {text}"
        assert text.count("(default:") <= 1, where
        assert "(default: None)" not in text and "(default: [])" not in text, where
        opt = tables.get(action.dest)
        if opt is not None and text.startswith(opt.help) and opt.default not in (None, (),
                                                                                  MISSING):
            assert f"(default: {opt.default})" in text, where  # the table's, not None
        elif _default_shown(action) and not isinstance(action.default, bool):
            assert "(default:" in text, where
    assert "usage:" in parser.format_help()


def test_the_demos_settings_are_pipeline_parameters():
    from kfvision.pipelines.flow.demo import DEMO_DEPLOY, DEMO_TRAIN

    assert set(DEMO_TRAIN) | set(DEMO_DEPLOY) <= set(TABLE)


HELP_WIDTH = 100  # one line of `--help`, as torchvision's references keep it


@pytest.mark.parametrize("command, parser", PARSERS, ids=[c for c, _ in PARSERS])
def test_every_help_is_one_short_line(command, parser):
    """An option's help (its default included) and a sub-command's are one line; the
    explanation is in the generated tables (`doc` of an option) and the docs."""
    formatter = parser._get_formatter()
    actions = [*parser._actions, *(c for a in parser._actions
                                   if isinstance(a, argparse._SubParsersAction)
                                   for c in a._choices_actions)]
    long = []
    for action in actions:
        if action.help in (None, argparse.SUPPRESS):
            continue
        text = formatter._expand_help(action)
        if "\n" in text or len(text) > HELP_WIDTH:
            long.append(f"{action.option_strings or action.dest}: {len(text)}: {text}")
    assert not long, f"kfvision {command}:\n" + "\n".join(long)
