"""Where the test suite's time goes: per file, its tests' time and the Python processes they start.

    python -m tools.suitecost install      # a start-up hook in this environment (.pth)
    KFVISION_PROCLOG=/tmp/procs.tsv python -m pytest -n 2 --dist loadfile --durations=0 \\
        --cost-log /tmp/cost
    python -m tools.suitecost table /tmp/procs.tsv /tmp/cost*   # the table of docs/development.md
    python -m tools.suitecost uninstall

The hook does nothing unless KFVISION_PROCLOG is set. Then every Python process of this
environment (`-I` ones too: the .pth is read from site-packages) appends a line when it starts,
another when it first imports torch, and one at a normal exit with its own CPU seconds ("end
3.412": none for a process killed or ended by os._exit), each with the test that was running
(pytest's PYTEST_CURRENT_TEST, which the processes a test starts inherit). Processes of other
environments (the wheel install's, a script's requirements') are not counted. The cost log is
tests/helpers/cost.py's `--cost-log` (wall, CPU, CPU of the processes a test waited for).
"""

import json
import sys
import sysconfig
from collections import defaultdict
from pathlib import Path

HOOK = "_kfvision_proccount"
HOOK_SOURCE = '''\
import os, sys, time
_log = os.environ.get("KFVISION_PROCLOG")
if _log:
    _test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]

    def _write(kind):
        try:
            with open(_log, "a") as f:
                f.write(f"{kind}\\t{os.getpid()}\\t{time.time():.3f}\\t{_test}\\t"
                        f"{' '.join(sys.argv)[:120]!r}\\n")
        except OSError:
            pass

    class _TorchSeen:
        seen = False

        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name == "torch" and not cls.seen:
                cls.seen = True
                _write("torch")

    def _end():
        import resource
        usage = resource.getrusage(resource.RUSAGE_SELF)
        _write(f"end {usage.ru_utime + usage.ru_stime:.3f}")

    import atexit
    atexit.register(_end)
    _write("start")
    sys.meta_path.insert(0, _TorchSeen)
'''


def _site() -> Path:
    return Path(sysconfig.get_path("purelib"))


def install() -> None:
    (_site() / f"{HOOK}.py").write_text(HOOK_SOURCE)
    (_site() / f"{HOOK}.pth").write_text(f"import {HOOK}\n")


def uninstall() -> None:
    for suffix in (".py", ".pth"):
        (_site() / f"{HOOK}{suffix}").unlink(missing_ok=True)


def table(proclog: Path, costlogs: list) -> str:
    """Markdown: per test file, tests, wall and CPU seconds (sums), Python processes started
    and how many imported torch; the heaviest first."""
    rows = defaultdict(lambda: {"tests": 0, "wall": 0.0, "cpu": 0.0, "procs": 0, "torch": 0})
    for log in costlogs:
        for line in Path(log).read_text().splitlines():
            t = json.loads(line)
            if "id" not in t:  # a wider fixture's line or a process's total
                continue
            r = rows[t["id"].split("::")[0]]
            r["tests"] += 1
            r["wall"] += t["wall"]
            r["cpu"] += t["cpu"] + t["kids"]
    for line in proclog.read_text().splitlines():
        kind, _pid, _when, test, _argv = line.split("\t", 4)
        if test and kind in ("start", "torch"):  # not a pytest worker itself
            rows[test.split("::")[0]]["torch" if kind == "torch" else "procs"] += 1
    out = ["| file | tests | wall s | CPU s | Python processes | of which import torch |",
           "|---|---:|---:|---:|---:|---:|"]
    total = {"tests": 0, "wall": 0.0, "cpu": 0.0, "procs": 0, "torch": 0}
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["cpu"]):
        out.append(f"| {name} | {r['tests']} | {r['wall']:.0f} | {r['cpu']:.0f} | "
                   f"{r['procs']} | {r['torch']} |")
        for k in total:
            total[k] += r[k]
    out.append(f"| all | {total['tests']} | {total['wall']:.0f} | {total['cpu']:.0f} | "
               f"{total['procs']} | {total['torch']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["install"]:
        install()
    elif argv[:1] == ["uninstall"]:
        uninstall()
    elif argv[:1] == ["table"] and len(argv) >= 3:
        print(table(Path(argv[1]), argv[2:]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
