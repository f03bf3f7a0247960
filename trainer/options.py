"""Options declared once: a config dataclass's field is the option (type, default) and carries the
rest (help, choices, range, the pipeline's name for it) in its metadata.

    @dataclass(frozen=True)
    class TrainConfig:
        lr: float = option(0.001, "base learning rate", low=0, high=10, low_open=True,
                           pipeline="learning_rate")

    options_of(TrainConfig)   # -> (Option("lr", float, 0.001, ...), ...)

From that one declaration come the command-line flags (add_flags), the range and choice checks
of `validate()` (check_options) and, in pipelines/, the pipeline's parameters and their help.
Torch-free and a leaf: it imports nothing of ours but kfvision.trainer.errors.
"""

import argparse
import functools
import types
from dataclasses import MISSING, dataclass, field, fields

from kfvision.trainer.errors import InvalidParameterError, check_choice, check_range, flag_name, ref


@dataclass(frozen=True)
class Option:
    """One option. `help`: one short line (`--help`); `doc`: the rest of the explanation, for
    the generated tables only. `default` MISSING: required. `high` may name another option of
    the same config (its value is the bound). `pipeline`: the pipeline parameter's name (True:
    the same name; False: not a pipeline parameter). `flag`: its flag where not the name's;
    `short`: a one-letter flag beside it (`-n`); `aliases`: older spellings the parsers still
    accept (and the pipeline's commands the parameter's spelling, as `--learning-rate`).
    `many`: a repeatable flag of items that `parse` reads and `show` writes back (in the
    pipeline one string, items separated by commas). `unset`: what no value (None) means."""

    name: str
    type: type
    default: object
    help: str
    choices: tuple = ()
    low: float | None = None
    high: float | str | None = None
    low_open: bool = False
    pipeline: bool | str = False
    flag: str | None = None
    short: str | None = None
    aliases: tuple = ()
    doc: str = ""
    metavar: str | None = None
    many: bool = False
    parse: object = None
    show: object = None
    unset: str | None = None

    @property
    def required(self) -> bool:
        return self.default is MISSING

    @property
    def param(self) -> str | None:
        """The pipeline parameter's name, or None when the pipeline has no such parameter."""
        return self.name if self.pipeline is True else (self.pipeline or None)

    @property
    def flag_name(self) -> str:
        return self.flag or flag_name(self.name)

    @property
    def flags(self) -> tuple:
        """The flags that set this option, its own first: one name in every command, then its
        short flag, then older spellings still accepted."""
        return (self.flag_name, *((self.short,) if self.short else ()), *self.aliases)

    @property
    def pipeline_flags(self) -> tuple:
        """The flags of its pipeline parameter (`kfvision pipeline submit | run-local`): its own
        first, then the parameter's spelling where that differs (`--learning-rate`)."""
        return tuple(dict.fromkeys((*self.flags, flag_name(self.param))))

    @property
    def ref(self) -> str:
        """How an error message names this option (see kfvision.trainer.errors.ref)."""
        return ref(self.name, self.flag)

    @property
    def param_default(self):
        """The pipeline's default: KFP parameters cannot be None, so "not set" is 0 or ''."""
        if self.many:
            return ""
        return self.type() if self.default is None else self.default

    def from_param(self, value):
        """A pipeline parameter's value as the config takes it ('' / 0 -> None, 'a,b' -> items)."""
        if self.many:
            return tuple(self.parse(item) for item in filter(None, (
                s.strip() for s in value.split(","))))
        return None if self.default is None and not value else value

    def check(self, value, config=None) -> None:
        """Raise InvalidParameterError unless `value` is one of the choices and in range."""
        if value is None or self.many:
            return
        if self.choices:
            check_choice(self.ref, value, self.choices)
        high = getattr(config, self.high) if isinstance(self.high, str) else self.high
        if self.low is None and high is None:
            return
        try:
            check_range(self.ref, value, self.low, high, low_open=self.low_open)
        except InvalidParameterError as e:
            if not isinstance(self.high, str):
                raise
            raise InvalidParameterError(f"{e.template[:-1]} ({high}: {ref(self.high)}).") from None

    def default_text(self, pipeline_default=MISSING) -> str:
        """' (default: X)' for the help, or '' when there is no default worth showing.
        pipeline_default: the pipeline parameter's default, for its flag."""
        pipeline = pipeline_default is not MISSING
        default = pipeline_default if pipeline else self.default
        if self.unset is not None and self.default is None:
            return f" (default: {f'{default!r}: ' if pipeline else ''}{self.unset})"
        if default is MISSING or default in (None, (), ""):
            return ""
        return f" (default: {default})"


def option(default=MISSING, help: str = "", **spec):
    """A dataclass field that is an option (see Option for `spec`)."""
    return field(default=default, metadata={"option": {"help": help, **spec}})


def _scalar(annotation) -> type:
    """int for `int | None`; the annotation itself otherwise."""
    if isinstance(annotation, types.UnionType):
        return next(a for a in annotation.__args__ if a is not type(None))
    return annotation


@functools.cache
def options_of(config_class) -> tuple:
    """The Options of a config dataclass, in field order (fields without option metadata are
    not options, e.g. TrainConfig's paths)."""
    out = []
    for f in fields(config_class):
        spec = f.metadata.get("option")
        if spec is not None:
            kind = str if spec.get("many") else _scalar(f.type)
            out.append(Option(name=f.name, type=kind, default=f.default, **spec))
    return tuple(out)


def ref_of(config_class, name: str) -> str:
    """How an error message names option `name` of a config dataclass (see
    kfvision.trainer.errors.ref)."""
    return next(o.ref for o in options_of(config_class) if o.name == name)


def check_options(config) -> None:
    """Check every option of a config dataclass instance (range, choices)."""
    for opt in options_of(type(config)):
        opt.check(getattr(config, opt.name), config)


class _SubParsersAction(argparse._SubParsersAction):
    """A sub-command refuses what it does not know itself, so that the error names it
    (`kfvision train: error: ...`) rather than the top-level command."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        unknown = vars(namespace).pop(argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if unknown:
            self._name_parser_map[values[0]].error(
                f"unrecognized arguments: {' '.join(unknown)}")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, except that it never expands an abbreviation (`--nproc` is not
    `--nproc-per-node`: an unknown flag is an error, not a guess) and says what is wrong in one
    line. Sub-commands get this class too (add_subparsers takes the parser's own class)."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)
        self.register("action", "parsers", _SubParsersAction)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default said once: the one its help already names, else argparse's unless
    there is none (None, '', or no item of a repeatable flag)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default:" in text or action.default in (None, "", []):
            return text
        return super()._get_help_string(action)


def _item_parser(opt: Option):
    def parse(text: str):
        try:
            return opt.parse(text)
        except InvalidParameterError as e:  # argparse shows this message, not "invalid value"
            raise argparse.ArgumentTypeError(str(e)) from e
    parse.__name__ = opt.name  # what argparse's own errors call the type
    return parse


def add_flags(group, options, *, defaults: bool = True, pipeline: dict | None = None) -> None:
    """Add one flag per option to an argparse parser or group; the help shows the default once.

    defaults False: every flag defaults to None, so a caller can tell what was given (and let a
    YAML file fill the rest); the help still shows the option's default. pipeline: the pipeline's
    {parameter: default (None: required)}, for the flags of its parameters (`--lr`, also
    `--learning-rate`, dest `learning_rate`; a `many` option is one comma-separated string
    there).
    """
    for opt in options:
        if pipeline is None:
            dest, default, text = opt.name, opt.default, opt.default_text()
        else:
            dest, default = opt.param, pipeline[opt.param]
            text = opt.default_text(default)
        kwargs = {"dest": dest, "help": opt.help + text}
        required = default is MISSING or (pipeline is not None and default is None)
        if opt.many and pipeline is None:
            kwargs.update(action="append", type=_item_parser(opt), default=[],
                          metavar=opt.metavar, help=kwargs["help"] + " (repeatable)")
        elif opt.type is bool:
            kwargs.update(action=argparse.BooleanOptionalAction,
                          default=default if defaults else None)
        else:
            choices = "{" + ",".join(map(str, opt.choices)) + "}" if opt.choices else None
            metavar = (f"{opt.metavar},..." if opt.many else
                       opt.metavar or choices or dest.upper())
            kwargs.update(type=opt.type, metavar=metavar, required=required and defaults,
                          default=None if required or not defaults else default)
        group.add_argument(*(opt.flags if pipeline is None else opt.pipeline_flags), **kwargs)
