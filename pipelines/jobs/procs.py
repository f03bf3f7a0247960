"""Process plumbing for `run-local`: one replica = one process tree, its log, and a clean stop.

Every replica is started in a session of its own (its own process group), so a Ctrl-C in the
terminal reaches only `run-local`, which then stops each tree on purpose. That is not enough on
its own: torchrun starts every training process in a *new* session too
(`torch.distributed.elastic...subprocess_handler`), so killing torchrun's group would leave them
behind. We therefore remember every descendant we have seen (pid + start time, read from /proc)
and signal those as well.
"""

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from pipelines.jobs.errors import InvalidJobError


def proc_table() -> dict:
    """{pid: (ppid, start time)} of every live (non-zombie) process, from /proc (Linux)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            data = Path(entry.path, "stat").read_text()
        except OSError:  # exited while we looked
            continue
        rest = data[data.rfind(")") + 2:].split()  # the command name may hold spaces and ')'
        if rest[0] != "Z":
            table[int(entry.name)] = (int(rest[1]), int(rest[19]))
    return table


def descendants(pid: int, table: dict | None = None) -> set:
    """{(pid, start time)} of every live descendant of `pid`."""
    table = proc_table() if table is None else table
    children = {}
    for p, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(p)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add((child, table[child][1]))
            todo.append(child)
    return found


def alive(ident: tuple, table: dict | None = None) -> bool:
    """Whether the process (pid, start time) still runs (a reused pid does not count)."""
    table = proc_table() if table is None else table
    pid, start = ident
    return pid in table and table[pid][1] == start


def exit_status(returncode: int) -> int:
    """Popen's return code as a container runtime reports it: a signal N becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class ReplicaProcess:
    """One replica's command, running in its own session; output to a log file and a callback."""

    def __init__(self, name: str, argv: list, env: dict, log_path: Path, on_line, cwd=None):
        self.name, self.argv, self.env, self.cwd = name, argv, env, cwd
        self.log_path, self.on_line = Path(log_path), on_line
        self.proc: subprocess.Popen | None = None
        self.seen: set = set()  # (pid, start time) of every descendant ever seen
        self._pump: threading.Thread | None = None

    def start(self, note: str | None = None) -> None:
        with self.log_path.open("a", encoding="utf-8") as f:
            if note:
                f.write(note + "\n")
        if note:
            self.on_line(self.name, note)
        # stdin from /dev/null: replicas are not interactive, and must not steal the terminal
        try:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise InvalidJobError(f"{self.name}: cannot start {self.argv[0]!r}"
                                  f"{f' in {self.cwd}' if self.cwd else ''}: {e}") from e
        self._pump = threading.Thread(target=self._copy_output, args=(self.proc.stdout,),
                                      name=f"log-{self.name}", daemon=True)
        self._pump.start()

    def _copy_output(self, stream) -> None:
        with self.log_path.open("a", encoding="utf-8") as f:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                f.write(line + "\n")
                f.flush()
                self.on_line(self.name, line)
        stream.close()

    def poll(self) -> int | None:
        """The exit status once the replica's main process has ended (its log fully copied)."""
        code = self.proc.poll()
        if code is None:
            return None
        # Descendants (e.g. a DataLoader worker) can hold the pipe open; they are stopped later.
        self._pump.join(timeout=2.0)
        return exit_status(code)

    def remember_descendants(self, table: dict) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.seen |= descendants(self.proc.pid, table)

    def tail(self, lines: int = 20) -> list:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[
                -lines:]
        except OSError:
            return []


def stop_all(replicas: list, grace_s: float = 5.0) -> None:
    """SIGTERM every replica's process group and every descendant seen, SIGKILL what outlives
    `grace_s`, then reap. Leaves no process behind that any replica started."""
    table = proc_table()
    for r in replicas:
        r.remember_descendants(table)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        table = proc_table()
        for r in replicas:
            if r.proc is None:
                continue
            if r.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.proc.pid, sig)
            for ident in r.seen:
                if alive(ident, table):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(ident[0], sig)
        if sig == signal.SIGTERM:
            _wait_gone(replicas, grace_s)
    for r in replicas:
        if r.proc is not None:
            r.proc.wait()
            if r._pump is not None:
                r._pump.join(timeout=2.0)
    _wait_gone(replicas, 2.0)


def _wait_gone(replicas: list, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        table = proc_table()
        if not any((r.proc is not None and r.proc.poll() is None)
                   or any(alive(i, table) for i in r.seen) for r in replicas):
            return
        time.sleep(0.1)
