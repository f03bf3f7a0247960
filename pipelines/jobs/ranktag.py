"""The `[node/rank] ` prefix of a job's log lines, one format for every place that shows them:
the boot writes it into each pod's log (torchrun's `--log-line-prefix-template` for the ranks,
`-` for the pod's own lines: the boot, pip, torchrun), `kfvision job run-local` prints such lines
as they are, and `kfvision job logs --all` interleaves the pods' logs by it.

    [0/0] epoch 1 loss 0.31       rank 0, on node 0
    [1/3] epoch 1 loss 0.33       rank 3, on node 1
    [1/-] [kfvision script] ...   node 1's own line, not a rank's
"""

import re

POD = "-"  # the rank of a line that no rank wrote
TAGGED = re.compile(r"\[\d+/(\d+|-)\] ")


def tag(node, rank=POD) -> str:
    """The prefix of a line of `rank` (or of the pod itself) on node `node`."""
    return f"[{node}/{rank}] "


def torchrun_template(node) -> str:
    """torchrun's `--log-line-prefix-template` giving `tag(node, rank)` (its ${rank} is the
    global rank)."""
    return tag(node, "${rank}")


def tagged(line: str, node, rank=POD) -> str:
    """`line` with the prefix of (node, rank) unless it already carries one."""
    return line if TAGGED.match(line) else tag(node, rank) + line


_GLUED = re.compile(r"(?<=.)(?=\[\d+/\d+\] )")


def split_glued(line: str) -> list:
    """`line` cut where another rank-tagged line starts inside it: torchrun's tee writes a rank's
    unfinished line (a progress bar, which ends in `\\r`, not a line break) and the next line of
    the rank's other stream after it, so `[0/0]  11%|#  | 1/9[0/0] {'loss': ...}` is two lines.
    Only a line that starts tagged is cut."""
    return _GLUED.split(line) if TAGGED.match(line) else [line]
