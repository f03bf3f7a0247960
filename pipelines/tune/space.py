"""The search space: `--param NAME=TYPE:SPEC`, in Katib's parameter types.

    lr=double:0.0001:0.1:log      warmup-epochs=int:0:3      batch-size=categorical:16,32,64

NAME is a training flag (or, tuning a user's script, a placeholder of its arguments:
pipelines/tune/script.py). A parameter turns into Katib's `parameters[]` entry (feasible space as
strings) and into Optuna's `suggest_*` call, so both searches mean the same space. Every bad
parameter is refused before anything runs, including a range whose ends the trainer itself would
refuse (checked with TrainConfig.validate and the fixed values of the other flags).
"""

import dataclasses
import re
from typing import NamedTuple

from kfvision.trainer.config import TrainConfig
from kfvision.trainer.errors import InvalidParameterError
from kfvision.trainer.options import options_of

TYPES = ("double", "int", "categorical")
# The training flags a search may set (paths, devices and runtime switches are not searched).
TUNABLE = ("lr", "momentum", "weight_decay", "lr_decay_power", "warmup_epochs", "batch_size",
           "epochs", "patience", "image_size", "augment", "seed", "recipe", "optimizer",
           "lr_schedule", "label_smoothing", "mixup_alpha", "cutmix_alpha", "ema_decay",
           "freeze_backbone_epochs", "norm_weight_decay")
# each field's type (int, not `int | None`: a searched value is always given)
_FIELD_TYPES = {o.name: o.type for o in options_of(TrainConfig)}
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")  # a flag's name, a script's placeholder, Katib's


class Param(NamedTuple):
    """One searched training option: `field` is TrainConfig's name, `name` the flag's."""

    name: str
    type: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    choices: tuple = ()

    @property
    def field(self) -> str:
        return self.name.replace("-", "_")

    def katib(self) -> dict:
        """Katib's `spec.parameters[]` entry (feasible spaces are strings there)."""
        if self.type == "categorical":
            space = {"list": [str(c) for c in self.choices]}
        else:
            space = {"min": str(self.low), "max": str(self.high),
                     "distribution": "logUniform" if self.log else "uniform"}
        return {"name": self.name, "parameterType": self.type, "feasibleSpace": space}

    def suggest(self, trial):
        """This parameter's value for an Optuna trial."""
        if self.type == "double":
            return trial.suggest_float(self.name, self.low, self.high, log=self.log)
        if self.type == "int":
            return trial.suggest_int(self.name, self.low, self.high, log=self.log)
        return trial.suggest_categorical(self.name, list(self.choices))

    def extremes(self) -> tuple:
        return self.choices if self.type == "categorical" else (self.low, self.high)


def _number(text: str, kind, where: str):
    try:
        return kind(text)
    except ValueError:
        raise InvalidParameterError(f"--param {where}: {text!r} is not of type "
                                    f"{kind.__name__}.") from None


def parse_param(text: str) -> Param:
    """Parse `NAME=TYPE:SPEC` as written, whatever NAME searches (a training flag, or a
    placeholder of a user's script: pipelines/tune/script.py); `check_space` types it for the
    trainer. Raises InvalidParameterError saying what to write."""
    name, sep, spec = text.partition("=")
    kind, _, rest = spec.partition(":")
    if not sep or not rest:
        raise InvalidParameterError(f"--param {text!r} is not NAME=TYPE:SPEC (e.g. "
                                    "lr=double:0.0001:0.1:log, batch-size=categorical:16,32).")
    if not NAME.fullmatch(name):
        raise InvalidParameterError(f"--param {name!r}: a name is a letter, then letters, digits, "
                                    "'-' or '_'.")
    if kind not in TYPES:
        raise InvalidParameterError(f"--param {name}: type {kind!r} is not one of "
                                    f"{', '.join(TYPES)}.")
    if kind == "categorical":
        values = [v for v in rest.split(",") if v]
        if not values:
            raise InvalidParameterError(f"--param {name}: the categorical list is empty; give "
                                        "values separated by commas.")
        if len(set(values)) != len(values):
            raise InvalidParameterError(f"--param {name}: a value is listed twice.")
        return Param(name, kind, choices=tuple(values))
    number = {"double": float, "int": int}[kind]
    parts = rest.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "log"):
        raise InvalidParameterError(f"--param {name}: write {kind}:MIN:MAX or {kind}:MIN:MAX:log.")
    low, high = (_number(p, number, name) for p in parts[:2])
    if low >= high:
        raise InvalidParameterError(f"--param {name}: min {low} must be less than max {high}.")
    log = len(parts) == 3
    if log and low <= 0:
        raise InvalidParameterError(f"--param {name}: a log range must be above 0 (min is {low}).")
    return Param(name, kind, low, high, log)


def _for_trainer(p: Param) -> Param:
    """`p` as a training flag's parameter: a searchable flag, values of the flag's type."""
    field = p.name.replace("-", "_")
    if field not in TUNABLE:
        raise InvalidParameterError(f"--param {p.name}: not a training option that can be "
                                    "searched; valid: "
                                    f"{', '.join(f.replace('_', '-') for f in TUNABLE)}.")
    flag, flag_type = field.replace("_", "-"), _FIELD_TYPES[field]
    if p.type == "categorical":
        choices = tuple(_number(v, flag_type, flag) for v in p.choices)
        if len(set(choices)) != len(choices):
            raise InvalidParameterError(f"--param {flag}: a value is listed twice.")
        return p._replace(name=flag, choices=choices)
    wanted = {float: "double", int: "int"}.get(flag_type)
    if p.type != wanted:
        fits = f"{wanted}:MIN:MAX or categorical" if wanted else "categorical:A,B,..."
        raise InvalidParameterError(f"--param {flag}: --{flag} takes {flag_type.__name__} "
                                    f"values, not {p.type}; use {fits}.")
    return p._replace(name=flag, low=flag_type(p.low), high=flag_type(p.high))


def check_space(params, base: TrainConfig) -> tuple:
    """`params` typed as the training flags they search; refuses a parameter that is no such
    flag or named twice, and any range end the trainer would refuse with the fixed values of
    `base` (e.g. warmup-epochs above epochs)."""
    typed = tuple(_for_trainer(p) for p in params)
    seen = set()
    for p in typed:
        if p.field in seen:
            raise InvalidParameterError(f"--param {p.name} is given twice.")
        seen.add(p.field)
    for p in typed:
        for value in p.extremes():
            try:
                dataclasses.replace(base, **{p.field: value}).validate()
            except InvalidParameterError as e:
                raise InvalidParameterError(f"--param {p.name}: its end {value} is not a valid "
                                            f"value: {e}") from e
    return typed


def apply(base: TrainConfig, values: dict) -> TrainConfig:
    """`base` with the searched values (by flag name) set, validated."""
    return dataclasses.replace(base, **{k.replace("-", "_"): v for k, v in values.items()}
                               ).validate()
