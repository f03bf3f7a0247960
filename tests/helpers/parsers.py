"""The `kfvision` parsers as the tests walk them: every command and sub-command, built as
`kfvision` builds them (kfvision.pipelines.cli.build_parser builds a command's flags only when the
command
line names it), and a command line parsed in-process, its exit code and one-line error kept."""

import argparse
import contextlib
import functools
import io

from kfvision.pipelines.cli import build_parser


@functools.cache
def command_parser(name: str | None) -> argparse.ArgumentParser:
    """The `kfvision` parser with command `name`'s flags built (None: the top level only)."""
    return build_parser([] if name is None else [name])


def sub_commands(parser: argparse.ArgumentParser) -> dict:
    """{name: parser} of a parser's sub-commands ({} when it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def every_parser() -> list:
    """[(words, parser)] of `kfvision` (words ()), each of its commands (("train",), ...), each
    of theirs (("job", "render"), ...); then the trainer's own (`python -m kfvision.trainer.train`,
    words None)."""
    from kfvision.trainer.config import get_args_parser

    out = [((), command_parser(None))]
    for name in sub_commands(command_parser(None)):
        todo = [((name,), sub_commands(command_parser(name))[name])]
        while todo:
            words, parser = todo.pop(0)
            out.append((words, parser))
            todo += [((*words, n), p) for n, p in sub_commands(parser).items()]
    return out + [(None, get_args_parser())]


def parse(argv: list, parser: argparse.ArgumentParser | None = None):
    """(exit code, standard error) of parsing `argv` as `kfvision` would (or with `parser`):
    code None when it parsed."""
    parser = parser or command_parser(argv[0] if argv and not argv[0].startswith("-") else None)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            return e.code, err.getvalue()
    return None, err.getvalue()


def _sample(action) -> str:
    if action.choices:
        return str(next(iter(action.choices)))
    return "1" if action.type in (int, float) else "x"


def minimal_argv(parser: argparse.ArgumentParser) -> list:
    """Arguments that `parser` accepts: a value for each required one, the first sub-command
    (with its own) where there are sub-commands."""
    argv = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name, child = next(iter(action.choices.items()))
            argv += [name, *minimal_argv(child)]
        elif not action.option_strings and action.nargs != 0:
            argv.append(_sample(action))
        elif action.required:
            argv += [action.option_strings[0], _sample(action)]
    return argv
