"""Progress bars in a job's log: a line a bar redraws (tqdm's `\\r`) is kept as its last state, at
most once every EVERY_S per rank, not as every redraw.

    redraws = Redraws()
    for line in lines:                 # as the boot relays them, `[node/rank] ` tagged
        for kept in redraws.feed(line):
            write(kept)
    for kept in redraws.flush():       # the bars' last states, at the end
        write(kept)

torchrun's tee reads each rank's output in text mode, so a `\\r` arrives as a line break: a bar
is known by tqdm's own format (`45%|████▌     | 9/20 [00:01<00:01,  6.1it/s]`), and a line
that still holds `\\r` (the `--launcher python` path) keeps what follows the last one. A bar's
last state is written before the next other line of its rank, when it completes (`20/20`), and
at the end; a rank's blank line (what a bar's clearing leaves, split at its `\r`s) is dropped. The
progress reader (pipelines/script/reporter.py) still sees every line.
"""

import re
import time

from kfvision.pipelines.jobs import ranktag

EVERY_S = 5.0
# tqdm's default bar: `{l_bar}{bar}| {n_fmt}/{total_fmt} [...]`, l_bar = `{desc}: {percentage}%|`
BAR = re.compile(r"\d{1,3}%\|[^|]*\|\s*(\d+(?:\.\d+)?[kMGT]?)/(\d+(?:\.\d+)?[kMGT]?)\b")


def last_state(line: str) -> str:
    """What a terminal would show of `line`: the text after its last `\r` (one at the end
    ignored)."""
    line = line.rstrip("\r")
    return line.rsplit("\r", 1)[-1]


class Redraws:
    """The throttle of one log's bars (module docstring)."""

    def __init__(self, every_s: float = EVERY_S, clock=time.monotonic):
        self.every_s, self.clock = every_s, clock
        self.pending, self.written = {}, {}  # rank tag -> last unwritten bar; when one was

    def feed(self, line: str) -> list:
        """The lines to write now for `line` (tagged, its `\r`s taken out: `last_state`)."""
        tag = ranktag.TAGGED.match(line)
        key = tag.group(0) if tag else ""
        text = line[tag.end():] if tag else line
        if tag and not text.strip():
            return []  # what a bar's clearing (`\r` + spaces + `\r`) leaves of a rank's line
        bar = BAR.search(text)
        if bar is None:
            before = self.pending.pop(key, None)
            return [before, line] if before is not None else [line]
        now = self.clock()
        if bar.group(1) == bar.group(2) or now - self.written.get(key, -1e18) >= self.every_s:
            self.pending.pop(key, None)
            self.written[key] = now
            return [line]
        self.pending[key] = line
        return []

    def flush(self) -> list:
        """The bars' last states not written yet."""
        out, self.pending = list(self.pending.values()), {}
        return out
