"""The boot's FAILED line (pipelines/script/boot.py): which rank of this pod failed first.

Under torchrun, kfvision's launcher prints a record per rank that ended and names the node's
first failure (trainer/failures.py); the boot reads those records as it relays the launcher's
output and says the same. Under `--launcher python` the pod runs one process, the boot's own
child: the boot stamps its exit itself and prints its record, in the same format, so that a
job's records can be ordered across pods whatever the launcher (`failures.first_failure`).
"""

import time
from collections import deque

from kfvision.trainer import exitcodes, failures

_KEPT = 200  # lines of the script's output kept for its last error


class Exits:
    """Watches what the launcher prints and when it ends; called with every line relayed."""

    def __init__(self):
        self.records: list = []
        self.lines: deque = deque(maxlen=_KEPT)
        self.signalled_at: float | None = None  # when the boot passed SIGTERM/SIGINT on
        self.ended_at: float | None = None
        self.pid: int | None = None

    def __call__(self, line: str) -> None:
        record = failures.parse(line)
        if record is not None:
            self.records.append(record)
        else:
            self.lines.append(line)

    def signalled(self) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.time()

    def ended(self, pid: int) -> None:
        self.pid, self.ended_at = pid, time.time()

    def failure_lines(self, code: int, node: str, began: float, rank: str | None) -> list:
        """What the boot says once the launcher exited with `code` (non-zero), `began`
        time.time() when it started; `rank`: the pod's one rank under `--launcher python`,
        None under torchrun."""
        took = (self.ended_at or time.time()) - began
        out = []
        if rank is not None:
            stopped = self.signalled_at is not None and self.signalled_at <= (self.ended_at or 0)
            record = failures.ExitRecord(
                int(rank), int(node), 0, self.pid or 0,
                failures.kind_of(code, failures.error_of(self.lines), stopped),
                self.ended_at or time.time(), took, code)
            out.append(record.line())
            self.records.append(record)
        verdict = failures.order(self.records)
        if verdict is not None:
            return [*out, f"FAILED: {verdict.summary()}"]
        return [*out, f"FAILED: node {node} exited with {code} ({exitcodes.describe(code)}) "
                f"after {took:.1f} s"]
