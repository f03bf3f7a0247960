"""Named errors for bad input. Every message says what is wrong, where, and what to do.

The command line prints the message (no traceback) and exits with `exit_code`. All of these are
permanent failures: retrying the same input gives the same error, so the exit code stays in 1-127
(a Kubeflow `ExitCode` restart policy treats 1-127 as permanent; the whole table of exit codes is
in trainer/exitcodes.py).
"""


class KfvisionError(Exception):
    """Base of every error kfvision raises on purpose."""

    exit_code = 2


class InvalidParameterError(KfvisionError, ValueError):
    """A parameter is out of its valid range or not one of the valid choices."""


class InvalidDatasetError(KfvisionError):
    """An image directory is missing, malformed, or does not fit the job (classes, images)."""


class NotLabeledDatasetError(InvalidDatasetError):
    """Training or evaluation was given an image directory that has no labels."""


class InvalidModelDirectoryError(KfvisionError):
    """A folder given as an (untrained or trained) model directory is not one."""


class NonFiniteLossError(KfvisionError):
    """The training loss became NaN or infinite."""

    exit_code = 3


class DeviceError(KfvisionError):
    """The requested device cannot be used (no CUDA, more processes than GPUs, ...)."""


def check_range(name, value, low=None, high=None, *, low_open=False):
    """Raise InvalidParameterError unless low <= value <= high (or low < value if low_open)."""
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        lo = "" if low is None else f"{low} {'<' if low_open else '<='} "
        hi = "" if high is None else f" <= {high}"
        raise InvalidParameterError(
            f"{name} = {value} is out of range: it must be {lo}{name}{hi}."
        )
    return value


def check_choice(name, value, choices):
    """Raise InvalidParameterError unless value is one of choices; the message lists them."""
    if value not in choices:
        raise InvalidParameterError(
            f"{name} = {value!r} is not valid; choose one of: {', '.join(map(str, choices))}."
        )
    return value


class UnsafeArchiveError(InvalidDatasetError):
    """An archive member would land outside the extraction folder, links outside it, or is a
    device file (PEP 706 `data` filter rules)."""


class DecompressionBombError(InvalidDatasetError):
    """An image has more pixels than Pillow's limit (PIL.Image.MAX_IMAGE_PIXELS)."""


class InvalidScoredTableError(KfvisionError):
    """A file given as a scored table (the CSV `kfvision score` writes) is not one."""


class ExportError(KfvisionError):
    """A trained model could not be exported, or the export does not match the model."""


class OutputError(KfvisionError):
    """The output location cannot be written: read-only, not ours, or full. Nothing is left
    half-written (every file is written to a temporary name and renamed)."""

    exit_code = 4


class CheckpointMismatchError(KfvisionError):
    """The checkpoint in the output folder is from a run with other settings."""
