"""Which rank failed first: the line each launcher prints per training process that ended, and
the order that names the cause, for one node or a whole job.

A failure spreads. One rank raises; its peers' next collective breaks ("Connection closed by
peer") a moment later, on every node; each node's launcher then stops the ranks it still runs
(SIGTERM). torchrun stamps each failure in whole seconds and breaks a tie by the lowest rank, so
its "first failure" was often a rank it had stopped itself, on the wrong node. kfvision's
launcher (trainer/exitwatch.py) stamps each exit to the microsecond and prints one record per
rank that ended, which anything reading the logs can order again across nodes:

    rank 3 (node 1, local rank 1, pid 817) failed at 2025-05-02T13:23:47.012345+00:00, 11.21 s
        after the start: exited with 1 (unexpected error: permanent)       [on one line]

Each record is one of three kinds:
- `failed`: the process ended by itself, and not from a lost peer: a candidate for the cause;
- `lost a peer`: it ended by itself from a broken collective (the trainer's exit code 200, or a
  script's last error a lost peer's, `exitcodes.is_peer_lost`): a consequence, named only when
  no rank failed otherwise (a node lost whole, a network cut);
- `stopped`: it ended after its launcher began to stop the processes: it never failed.

Why not by time alone: the trainer, and many scripts, destroy the process group in a `finally`
before the exception reaches the top, so the peers see the collective break while the failing
rank is still printing its traceback, and may exit before it does.

`first_failure(lines)` reads the records out of any log lines (one pod's or every pod's, with
whatever prefixes) and returns the Verdict; its `summary()` is what the FAILED lines say.
"""

import re
from dataclasses import dataclass
from datetime import datetime, timezone

from kfvision.trainer import exitcodes

FAILED, LOST_PEER, STOPPED = "failed", "lost a peer", "stopped"
KINDS = (FAILED, LOST_PEER, STOPPED)
LISTED = 8  # ranks a summary names one by one in each list; the rest are counted

_RECORD = re.compile(
    r"rank (?P<rank>\d+) \(node (?P<node>\d+), local rank (?P<local>\d+), pid (?P<pid>\d+)\) "
    r"(?P<kind>failed|lost a peer|stopped) at (?P<at>\S+), (?P<after>[\d.]+) s after the "
    r"start: exited with (?P<code>\d+)\b")
# The last line of a Python traceback (torch prefixes each rank's with "[rankN]: "; the trainer
# prints "error: TYPE: message"): its exception's type and message.
_ERROR = re.compile(r"^(?:\[rank\d+\]:\s*|error:\s*)?(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*"
                    r"(?:Error|Exception|Interrupt|Exit))(?::\s*(?P<message>.*))?$")


@dataclass(frozen=True)
class ExitRecord:
    """How one training process ended: `code` as a container reports it (a signal N: 128 + N),
    `at` wall-clock seconds (time.time()), `after` seconds since its launcher started."""

    rank: int
    node: int
    local_rank: int
    pid: int
    kind: str
    at: float
    after: float
    code: int

    def line(self) -> str:
        """The record as the launcher prints it (after its own prefix)."""
        when = datetime.fromtimestamp(self.at, timezone.utc).isoformat(timespec="microseconds")
        return (f"rank {self.rank} (node {self.node}, local rank {self.local_rank}, pid "
                f"{self.pid}) {self.kind} at {when}, {self.after:.2f} s after the start: exited "
                f"with {self.code} ({exitcodes.describe(self.code)})")

    @property
    def where(self) -> str:
        return f"rank {self.rank} on node {self.node}"


def parse(line: str) -> ExitRecord | None:
    """The record a log line holds (anywhere in it: after a `[node/rank] ` tag, a replica's
    name, kubectl's timestamp), or None."""
    m = _RECORD.search(line)
    if m is None:
        return None
    try:
        at = datetime.fromisoformat(m["at"]).timestamp()
    except ValueError:
        return None
    return ExitRecord(int(m["rank"]), int(m["node"]), int(m["local"]), int(m["pid"]), m["kind"],
                      at, float(m["after"]), int(m["code"]))


def error_of(lines) -> str | None:
    """The last exception line (`TYPE: message`) among `lines`, or None."""
    found = None
    for line in lines:
        m = _ERROR.match(line.strip())
        if m:
            found = f"{m['type']}: {m['message'] or ''}".rstrip(": ")
    return found


def kind_of(code: int, error: str | None, stopped: bool) -> str:
    """A record's kind: `stopped` when it ended after its launcher began to stop the processes,
    else `lost a peer` for exit code 200 or a lost peer's error (`TYPE: message`), else
    `failed`."""
    if stopped:
        return STOPPED
    if code == exitcodes.EXIT_PEER_LOST:
        return LOST_PEER
    if error:
        type_name, _, message = error.partition(": ")
        if exitcodes.is_peer_lost(type_name, message):
            return LOST_PEER
    return FAILED


@dataclass(frozen=True)
class Verdict:
    """The first failure and what came after it: `following` the other ranks that ended by
    themselves (failed or lost a peer), `stopped` those their launcher stopped, each in the
    order they ended."""

    first: ExitRecord
    following: tuple
    stopped: tuple

    def summary(self, first_of: str = "") -> str:
        """`rank R on node N exited with C (meaning) after S s`, then who followed and who was
        stopped; `first_of` ("the job's first failure") is said after the first's own words."""
        f = self.first
        text = (f"{f.where} exited with {f.code} ({exitcodes.describe(f.code)}) after "
                f"{f.after:.1f} s")
        if f.kind == LOST_PEER:
            text += ", having lost a peer"
        if first_of:
            text += f", {first_of}"
        if self.following:
            text += "; following: " + _listed(
                self.following, lambda r: f"{r.where} ({r.at - f.at:+.2f} s"
                f"{', lost a peer' if r.kind == LOST_PEER else ''})")
        if self.stopped:
            text += "; stopped: " + _listed(self.stopped, lambda r: r.where)
        return text


def _listed(records, name) -> str:
    shown = ", ".join(name(r) for r in records[:LISTED])
    more = len(records) - LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def order(records) -> Verdict | None:
    """The Verdict of `records` (ExitRecords of one node or of many): the earliest `failed`,
    else the earliest `lost a peer`; None when every rank was stopped or none ended."""
    ranked = sorted(set(records), key=lambda r: (r.at, r.node, r.rank))
    ended = [r for r in ranked if r.kind != STOPPED]
    first = next((r for r in ended if r.kind == FAILED), ended[0] if ended else None)
    if first is None:
        return None
    return Verdict(first, tuple(r for r in ended if r is not first),
                   tuple(r for r in ranked if r.kind == STOPPED))


def first_failure(lines, since: float | None = None) -> Verdict | None:
    """The first failure of a job from its log lines: every pod's, in any order, with any
    prefixes (`kfvision job run-local`'s log files, `kubectl logs`, `kfvision job logs --all`).

    Args:
        lines: text lines holding the records kfvision's launchers (and a script's boot under
            `--launcher python`) print.
        since: wall-clock seconds; records of exits before it are left out (those of an attempt
            that was retried: a local log file keeps every attempt).
    Returns:
        The Verdict (`.summary()` is the one line), or None when no record names a failure.
    """
    records = [r for r in map(parse, lines) if r is not None]
    return order([r for r in records if since is None or r.at >= since])
