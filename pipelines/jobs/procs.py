"""Process plumbing for `run-local`: one replica = one process tree, its log, and a clean stop.

Every replica is started in a session of its own (its own process group), so a Ctrl-C in the
terminal reaches only `run-local`, which then stops each tree on purpose. That is not enough on
its own: torchrun starts every training process in a *new* session too
(`torch.distributed.elastic...subprocess_handler`), so killing torchrun's group would leave them
behind. We therefore remember every descendant we have seen (pid + start time, read from /proc),
and mark each replica's environment (`MARK_VAR`) to find those we never saw; all are signalled.
Ctrl-C and SIGTERM are recorded, not raised, while replicas run (`supervised`, signals.py).

Also what both kinds' local runners share: a pod's environment here (`pod_env`, `gpu_env`), its
command (`container_argv`), the prefixed log printer and the run's result (the failure report:
pipelines/jobs/failed.py).
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kfvision.pipelines.clients.k8s import GPU_RESOURCE
from kfvision.pipelines.jobs import ranktag
from kfvision.pipelines.jobs.errors import InvalidJobError
from kfvision.pipelines.jobs.home import CACHE_VARS
from kfvision.pipelines.jobs.signals import STOP

# Launcher variables a parent process may have set; a pod starts without them.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                  "MASTER_PORT")


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


# In every replica's environment, so in that of every process it starts (even one in a session
# of its own whose parent has exited, which no walk of the process tree finds): a pod's cgroup,
# here. Jenkins's ProcessTreeKiller marks a build's processes the same way.
MARK_VAR = "KFVISION_RUN_LOCAL_REPLICA"


def marked(marks: set, table: dict | None = None) -> set:
    """{(pid, start time)} of every live process whose environment holds MARK_VAR=<one of marks>
    (processes of other users, unreadable, are not ours anyway)."""
    table = proc_table() if table is None else table
    wanted = {f"{MARK_VAR}={m}".encode() for m in marks}
    found = set()
    for pid, (_, start) in table.items():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # exited, or not ours
            continue
        if wanted.intersection(env.split(b"\0")):
            found.add((pid, start))
    return found


def exit_status(returncode: int) -> int:
    """Popen's return code as a container runtime reports it: a signal N becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class ReplicaProcess:
    """One replica's command, running in its own session; output to a log file and a callback."""

    def __init__(self, name: str, argv: list, env: dict, log_path: Path, on_line, cwd=None,
                 memory=None):
        self.name, self.argv, self.env, self.cwd = name, argv, env, cwd
        self.memory = memory  # the pod's memory cgroup (pipelines/jobs/memlimit.py) or None
        self.log_path, self.on_line = Path(log_path), on_line
        self.proc: subprocess.Popen | None = None
        self.seen: set = set()  # (pid, start time) of every descendant ever seen
        self.mark = uuid.uuid4().hex  # MARK_VAR's value for this replica
        self.started_at: float | None = None  # time.time() of its last start
        self._pump: threading.Thread | None = None

    def start(self, note: str | None = None) -> None:
        with self.log_path.open("a", encoding="utf-8") as f:
            if note:
                f.write(note + "\n")
        if note:
            self.on_line(self.name, note)
        # stdin from /dev/null: replicas are not interactive, and must not steal the terminal
        self.started_at = time.time()
        try:
            self.proc = subprocess.Popen(self.argv, env={**self.env, MARK_VAR: self.mark},
                                         cwd=self.cwd,
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
        if self.memory is not None and self.memory.oom_killed():
            note = (f"OOMKilled: a process of the pod passed its limits.memory "
                    f"({self.memory.limit} bytes) and the kernel killed it, as the kubelet would")
            with self.log_path.open("a", encoding="utf-8") as f:
                f.write(note + "\n")
            self.on_line(self.name, note)
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


@contextlib.contextmanager
def supervised(replicas: list):
    """Run the block with SIGINT and SIGTERM recorded (pipelines/jobs/signals.py; the block calls
    `STOP.check()` between its steps), and stop every replica on the way out, however it ends.
    Raises Interrupted when a signal came, even one that came while stopping after success."""
    with STOP:
        STOP.check()  # one that came before any replica started
        try:
            yield
        finally:
            stop_all(replicas)
        STOP.check()


def stop_all(replicas: list, grace_s: float = 5.0) -> None:
    """SIGTERM every process of every replica (its process group, every descendant seen, every
    process bearing its mark), SIGKILL what outlives `grace_s`, then reap. Leaves no process
    behind that any replica started.

    A SIGINT or SIGTERM that comes meanwhile (a second Ctrl-C) ends the grace period: SIGKILL
    at once."""
    signals_before = len(STOP.received)
    table = proc_table()
    for r in replicas:
        r.remember_descendants(table)
    _signal_all(replicas, signal.SIGTERM)
    _wait_gone(replicas, grace_s, until=lambda: len(STOP.received) > signals_before)
    # SIGKILL until none is left: one that forked meanwhile has a child to kill too
    end = time.monotonic() + 10.0
    while _signal_all(replicas, signal.SIGKILL) and time.monotonic() < end:
        time.sleep(0.05)
    for r in replicas:
        if r.proc is not None:
            reap(r.proc)
            if r._pump is not None:
                r._pump.join(timeout=2.0)
    _wait_gone(replicas, 2.0)
    for r in replicas:
        if r.memory is not None:
            r.memory.close()


def _alive_of(replicas: list, table: dict) -> set:
    """(pid, start time) of every live process of `replicas`: seen in their trees or marked."""
    seen = set().union(*(r.seen for r in replicas))
    return {i for i in seen if alive(i, table)} | marked({r.mark for r in replicas}, table)


def _is_sandbox(pid: int) -> bool:
    """Whether process `pid` is bubblewrap, the pod's filesystem around a replica
    (pipelines/jobs/sandbox.py)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "bwrap"
    except OSError:
        return False


def _signal_all(replicas: list, sig: int) -> bool:
    """Send `sig` to every live process of `replicas`; whether there was any.

    Short of SIGKILL, bubblewrap itself is spared: it would die of the signal and, being
    started with --die-with-parent, take the pod's processes with it at once, where a pod's
    processes get the signal and their grace period (the kubelet's SIGTERM). They are signalled
    one by one here instead, as descendants."""
    table = proc_table()  # without zombies: a killed main process no longer counts
    sent = False
    spare = sig != signal.SIGKILL
    for r in replicas:
        if r.proc is not None and r.proc.returncode is None:  # not reaped: its pid is its own
            if spare and any(_is_sandbox(pid) for pid, _ in r.seen | {(r.proc.pid, 0)}):
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, sig)
                sent = sent or r.proc.pid in table
    for pid, _ in _alive_of(replicas, table):
        if spare and _is_sandbox(pid):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            sent = True
    return sent


REAP_S = 5.0  # how long `reap` lets Popen.wait try before it calls waitpid itself


def reap(proc: subprocess.Popen) -> None:
    """Wait for a process that was sent SIGKILL. Popen.wait() alone can block for ever: an
    exception a signal handler raises (Python's own Ctrl-C handler, a test's timeout) inside
    Popen.poll() after it took its waitpid lock and before its `try` (CPython 3.11
    subprocess.py, _internal_poll) leaves the lock taken, and every later wait() queues on it.
    Then the child is reaped with os.waitpid directly."""
    try:
        proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ChildProcessError):  # reaped meanwhile
            _, status = os.waitpid(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)


def _wait_gone(replicas: list, seconds: float, until=lambda: False) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not until():
        if not (any(r.proc is not None and r.proc.poll() is None for r in replicas)
                or _alive_of(replicas, proc_table())):
            return
        time.sleep(0.1)


def container_env(container: dict, source: str) -> dict:
    """The container's env here: its plain values. A Secret's key (valueFrom.secretKeyRef, as
    --s3-credentials renders them) is not in the file and there is no cluster to ask: the
    variable keeps this machine's own value (pod_env starts from this environment), so a job
    that reads s3:// runs here with the AWS_* variables of the shell that runs it. A key the
    job needs (not `optional`) that this machine does not set is refused; other valueFrom
    sources are too."""
    env = {}
    for item in container.get("env") or []:
        name, ref = item.get("name"), (item.get("valueFrom") or {}).get("secretKeyRef")
        if "value" in item:
            env[name] = str(item["value"])
        elif ref is not None and (ref.get("optional") or name in os.environ):
            continue
        elif ref is not None:
            raise InvalidJobError(f"{source}: env {name!r} is key {ref.get('key')!r} of Secret "
                                  f"{ref.get('name')!r}, which run-local cannot read (no "
                                  f"cluster); set {name} here to stand in for it.")
        else:
            raise InvalidJobError(f"{source}: env {name!r} uses valueFrom, which run-local "
                                  "cannot resolve (no cluster); give a plain value.")
    return env


def gpu_env(plan, plans: list) -> dict:
    """CUDA_VISIBLE_DEVICES as the device plugin would leave it: the pod's own GPUs, or none.
    `plan`: a replica's (or node's) plan, one of `plans`; its `.container` asks for the GPUs."""
    limits = (plan.container.get("resources") or {}).get("limits") or {}
    want = int(limits.get(GPU_RESOURCE, 0))
    if want == 0:
        return {"CUDA_VISIBLE_DEVICES": ""}  # a pod that asked for no GPU sees none
    host = os.environ.get("CUDA_VISIBLE_DEVICES")
    if host is not None:
        devices = [d for d in host.split(",") if d]
    else:
        import torch  # only when the job asks for GPUs: torch takes a second to import

        devices = [str(i) for i in range(torch.cuda.device_count())]
    first = sum(int(((p.container.get("resources") or {}).get("limits") or {})
                    .get(GPU_RESOURCE, 0)) for p in plans[:plans.index(plan)])
    if first + want > len(devices):
        raise InvalidJobError(f"the job asks for {GPU_RESOURCE}: {want} per pod (at least "
                              f"{first + want} in all) but this machine has {len(devices)} GPU(s); "
                              "render it with fewer --nodes/--gpus-per-node to run it here.")
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[first:first + want])}


def pod_env(container: dict, source: str) -> dict:
    """A pod's start environment here: the host's (standing in for the image's, and for the
    Secrets' keys) less launcher variables and the caller's caches (a pod has its own:
    pipelines/jobs/home.py), this environment's bin folder first on PATH, then the container's
    env."""
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith(("PET_", "TORCHELASTIC_"))
           and (k == "HOME" or k not in CACHE_VARS)}
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env.update(container_env(container, source))
    return env


def container_argv(container: dict, env: dict, source: str) -> tuple:
    """(argv with the command resolved on env's PATH, env)."""
    argv = [*container["command"], *(container.get("args") or [])]
    exe = shutil.which(argv[0], path=env["PATH"])
    if exe is None:
        raise InvalidJobError(f"{source}: {argv[0]!r} (the container's command) is not on PATH "
                              "here; run-local uses this machine's programs in place of the image.")
    return [exe, *argv[1:]], env


@dataclass
class LocalResult:
    """How a local run ended."""

    name: str
    seconds: float
    restarts: int
    log_dir: Path
    exit_codes: dict = field(default_factory=dict)
    faults: list = field(default_factory=list)  # what each injected fault did


class Printer:
    """Prefixes each replica's lines with `[master-0]` and keeps concurrent lines whole; a line
    that carries its `[node/rank] ` already (a user's script: pipelines/jobs/ranktag.py) is
    printed as it is, as `kfvision job logs --all` shows it. Each line also goes to `also`
    (the run's record: pipelines/jobs/localstatus.py), quiet or not."""

    def __init__(self, stream, quiet: bool, also=None):
        self.stream, self.quiet, self.lock, self.also = stream, quiet, threading.Lock(), also

    def __call__(self, name: str, line: str) -> None:
        if self.also is not None:
            self.also(name, line)
        if not self.quiet:
            shown = line if ranktag.TAGGED.match(line) else f"[{name}] {line}"
            with self.lock:
                self.stream.write(shown + "\n")
                self.stream.flush()
