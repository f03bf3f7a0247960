"""The `name=value` pairs of a log line, read as Katib's StdOut metrics collector reads them: the
one definition that tuning (the objective of a trial), a script's progress (pipelines/jobs/
progress.py) and `kfvision job status` share.

    epoch=3 loss=0.412 validation-accuracy=0.951   ->  {"epoch": 3.0, "loss": 0.412, ...}
"""

import re

# The StdOut and File collectors' default filter (kubeflow/katib v0.19.0
# pkg/metricscollector/v1beta1/common/const.go DefaultFilter, applied by
# pkg/metricscollector/v1beta1/file-metricscollector/file-metricscollector.go
# parseLogsInTextFormat to every line that contains a metric's name; Go's \w is ASCII)
DEFAULT_FILTER = re.compile(r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)",
                            re.ASCII)


def parse_metrics(line: str) -> dict:
    """{name: value} of the `name=value` pairs of `line` (the filter also matches an empty or
    signless value, `a==b`, `e5`: no number, left out; a name given twice keeps its last)."""
    found = {}
    for m in DEFAULT_FILTER.finditer(line):
        try:
            found[m.group(1)] = float(m.group(2))
        except ValueError:
            continue
    return found


# Hugging Face Trainer's own lines (transformers 5.x, src/transformers/trainer.py and
# trainer_callback.py): ProgressCallback.on_log prints the log dict on the main process, its
# values quoted since 5.0 (`{'loss': '1.392', 'grad_norm': '3.611', 'epoch': '0.2'}`), plain
# numbers before; `_inner_training_loop` says the run's size at INFO (TrainingArguments
# log_level="info"), transformers 5's logger prefixing `[transformers] `:
# "  Num Epochs = 3", "  Total optimization steps = 9", "  Num examples = 96", ...
_DICT = re.compile(r"\{\s*'[A-Za-z_][\w./-]*'\s*:.*\}")
_BANNER = re.compile(r"(?:\[transformers\])?\s+([A-Z][A-Za-z .&(),-]*?)\s*=\s*([\d,]+)\s*")
# what each line of the banner gives: a total kfvision reads, or nothing (not a metric)
_BANNER_TOTALS = {"Num Epochs": "num_train_epochs", "Total optimization steps": "max_steps"}
_BANNER_OTHERS = ("Num examples", "Num update steps per epoch", "Batch size",
                  "Instantaneous batch size per device", "Gradient Accumulation steps",
                  "Number of trainable parameters", "Continuing training from")


def trainer_dict(line: str) -> dict:
    """{name: value} of a Trainer's log dict (module comment), numbers and quoted numbers alike
    ({} for a line that is no such dict; entries that are not numbers left out)."""
    import ast

    text = line.strip()
    if not _DICT.fullmatch(text):
        return {}
    try:
        found = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return {}
    out = {}
    for name, value in found.items() if isinstance(found, dict) else ():
        if isinstance(value, bool) or not isinstance(name, str):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        out[name] = number
    return out


def progress_pairs(line: str) -> dict:
    """The pairs of a line a job prints as its progress: a Trainer's size line (as the total
    it gives: `max_steps`, `num_train_epochs`), its log dict, else `name=value` pairs."""
    m = _BANNER.fullmatch(line)
    if m and m.group(1) in _BANNER_TOTALS:
        return {_BANNER_TOTALS[m.group(1)]: float(m.group(2).replace(",", ""))}
    if m and m.group(1).startswith(("Total train batch size", *_BANNER_OTHERS)):
        return {}  # the banner's other lines: sizes, not metrics
    return trainer_dict(line) or parse_metrics(line)
