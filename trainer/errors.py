"""Named errors for bad input. Every message says what is wrong, where, and what to do.

The command line prints the message (no traceback) and exits with `exit_code`. All of these are
permanent failures: retrying the same input gives the same error, so the exit code stays in 1-127
(a Kubeflow `ExitCode` restart policy treats 1-127 as permanent; the whole table of exit codes is
in trainer/exitcodes.py).
"""


class KfvisionError(Exception):
    """Base of every error kfvision raises on purpose."""

    exit_code = 2


# Marks an option's field name in a message (ASCII unit and record separators: nothing a user
# types), and the flag after it where that is not the field's kebab-case.
_REF, _FLAG = "\x1f", "\x1e"


def ref(field: str, flag: str | None = None) -> str:
    """Option `field` (a config field, e.g. "warmup_epochs") as an InvalidParameterError message
    names it: each front end writes it its own way (the command line `--warmup-epochs`, or
    `flag` where given; the pipeline `warmup_epochs`), so a message is written once for all."""
    return f"{_REF}{field}{_FLAG + flag if flag else ''}{_REF}"


def flag_name(field: str) -> str:
    """The command-line flag of a field: warmup_epochs -> --warmup-epochs."""
    return "--" + field.replace("_", "-")


def _as_flag(field: str) -> str:
    name, _, flag = field.partition(_FLAG)
    return flag or flag_name(name)


class InvalidParameterError(KfvisionError, ValueError):
    """A parameter is out of its valid range or not one of the valid choices.

    The message may name options through `ref(field)`; `str()` writes them as flags, `named()`
    as a front end names them, `renamed()` re-targets them (e.g. onto pipeline parameters).
    `field`: the first option the message names (None if it names none).
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.template = message
        self.field = (self._fields() or [None])[0]

    def _fields(self) -> list:
        return [f.partition(_FLAG)[0] for f in self.template.split(_REF)[1::2]]

    def _render(self, write) -> str:
        parts = self.template.split(_REF)
        parts[1::2] = [write(f) for f in parts[1::2]]
        return "".join(parts)

    def named(self, name_of) -> str:
        """The message with each option written as `name_of(field)`."""
        return self._render(lambda f: name_of(f.partition(_FLAG)[0]))

    def renamed(self, rename) -> "InvalidParameterError":
        """The same error (same class) naming `rename(field)` wherever it named `field`."""
        return type(self)(self.named(lambda f: ref(rename(f))))

    def __str__(self) -> str:
        return self._render(_as_flag)


class FamilyOptionError(InvalidParameterError):
    """A model option that the chosen architecture's family does not take (e.g. --dropout for a
    ResNet): the message names the families that do."""


class ImageSizeError(InvalidParameterError):
    """An image size the chosen architecture cannot take (e.g. MaxViT's windows need a multiple
    of 224): the message names sizes it does take."""


class InvalidDatasetError(KfvisionError):
    """An image directory is missing, malformed, or does not fit the job (classes, images)."""


class ChangedDatasetError(InvalidDatasetError):
    """An image an image directory lists is missing or differs from what its manifest recorded
    (size or sha256): it changed after the directory was made, or while convert was reading it."""


class NotLabeledDatasetError(InvalidDatasetError):
    """Training or evaluation was given an image directory that has no labels."""


class InvalidModelDirectoryError(KfvisionError):
    """A folder given as an (untrained or trained) model directory is not one, or its weights do
    not fit its architecture. Only that: a storage, parameter or evaluation problem has its own
    error (tests/trainer/test_errors.py checks every raise)."""


class DataArrivalError(KfvisionError):
    """An image the trainer reads from a node's fetched copy of object storage never came: the
    fetcher failed or stalled (trainer/data/arrival.py). Another try may fetch it."""

    exit_code = 69  # exitcodes.EXIT_UNAVAILABLE: what the fetcher's own transfer errors exit with


class StorageError(KfvisionError):
    """The storage a step needs is not there: neither the run's KFP workspace nor the data PVC,
    or a PVC that is not mounted where the step must read or write it."""


class EvaluationError(KfvisionError):
    """An evaluation (the metrics.json `kfvision evaluate` and the evaluate step write) cannot be
    read."""


class NonFiniteLossError(KfvisionError):
    """The training loss became NaN or infinite."""

    exit_code = 3


class DeviceError(KfvisionError):
    """The requested device cannot be used (no CUDA, more processes than GPUs, ...)."""


def check_range(name, value, low=None, high=None, *, low_open=False):
    """Raise InvalidParameterError unless low <= value <= high (or low < value if low_open).

    `name`: how the message names the parameter (`ref(field)` for an option)."""
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


class ExportNotSupportedError(ExportError):
    """A model cannot be exported to the format asked for (a script's TorchScript or ONNX model
    to a format that would need its Python code)."""


class QuantizationError(ExportError):
    """A quantized export loses more top-1 accuracy against its fp32 export than allowed; it is
    not written."""


class Int8CpuMismatchError(KfvisionError):
    """An int8 export was quantized for CPUs whose int8 kernels accumulate in 32 bits (VNNI, AMX)
    and the running CPU's kernels would saturate its full-range weights: re-export it here."""


class OutputError(KfvisionError):
    """The output location cannot be written: read-only, not ours, or full. Nothing is left
    half-written (every file is written to a temporary name and renamed)."""

    exit_code = 4


class CheckpointMismatchError(KfvisionError):
    """The checkpoint in the output folder is from a run with other settings."""
