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
