"""Markers by cost (a pytest plugin, loaded by tests/conftest.py).

Each test's cost is measured in CPU seconds, which a shared machine barely changes (wall time on
two busy cores changes by 10x): the test's own process (every thread) and the processes it
started and waited for (`RUSAGE_CHILDREN`: their children too, once reaped). What a fixture of
wider scope than the function costs (the digits, a shared job, a server) is left out: the test
that happens to ask first would pay for all of them. Only setup and call are counted; a
function fixture's teardown is not.

A test without a cost marker fails (pyproject's `kfvision_cost_check`: "fail"; "fail-process"
fails only the first kind below and lists the second; "warn" lists both at the end of the run)
when it
- spent `kfvision_process_cpu_s` (pyproject) or more in processes it started: a Python process
  that imports torch costs 1-3 s of CPU before it does anything; nothing cheap comes near it
  (a `kfvision` command without torch: 0.1 s). Mark it `process`, or `slow`/`distributed`;
- spent more than `kfvision_unmarked_cpu_s` (5 s) in all: mark it `slow` (or `distributed`).

`--cost-log FILE` writes one JSON line per test (wall, CPU, children's CPU, markers, the time it
ended), one per setup of a wider-scope fixture (its name and scope) and one per process at its
end (the whole process and its children): the durations table of docs/development.md is made
from it (tools/suitecost.py).
"""

import json
import os
import resource
import time

import pytest

PROCESS_OK = ("process", "slow", "distributed", "stress")  # may start torch processes
SLOW_OK = ("slow", "distributed", "stress")  # may cost more than the limit


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class _Meter:
    def __init__(self):
        self.wall = self.cpu = self.kids = 0.0
        self.left_out = [0.0, 0.0]  # CPU, children's CPU of wider-scope fixtures

    def start(self):
        self.wall, self.cpu, self.kids = time.monotonic(), time.process_time(), _children_cpu()
        self.left_out = [0.0, 0.0]

    def totals(self) -> tuple:
        """(wall, own CPU, children's CPU) since start, less the wider-scope fixtures."""
        return (time.monotonic() - self.wall,
                time.process_time() - self.cpu - self.left_out[0],
                _children_cpu() - self.kids - self.left_out[1])


_meter = _Meter()


def pytest_addoption(parser):
    parser.addini("kfvision_process_cpu_s", "children's CPU seconds from which an unmarked test "
                  "counts as starting a torch-importing process", default="1.0")
    parser.addini("kfvision_unmarked_cpu_s", "CPU seconds an unmarked test may cost",
                  default="5")
    parser.addini("kfvision_cost_check", "fail: an unmarked test that costs more fails; warn: "
                  "it is listed at the end of the run; fail-process: fail for a torch process, "
                  "list for CPU", default="fail")
    parser.addoption("--cost-log", metavar="FILE", help="one JSON line per test: its cost")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _meter.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope == "function":
        yield
        return
    wall, cpu, kids = time.monotonic(), time.process_time(), _children_cpu()
    yield
    cpu, kids = time.process_time() - cpu, _children_cpu() - kids
    _meter.left_out[0] += cpu
    _meter.left_out[1] += kids
    _log(request.config, {"fixture": fixturedef.argname, "scope": fixturedef.scope,
                          "wall": round(time.monotonic() - wall, 3), "cpu": round(cpu, 3),
                          "kids": round(kids, 3), "end": round(time.time(), 3)})


def _log(config, line: dict) -> None:
    """One JSON line into --cost-log's file (FILE.gwN under pytest-xdist)."""
    log = config.getoption("cost_log")
    if log:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        with open(f"{log}.{worker}" if worker else log, "a") as f:
            f.write(json.dumps(line) + "\n")


def _marks(item) -> set:
    return {m.name for m in item.iter_markers()}


def verdict(marks: set, cpu: float, kids: float, process_s: float, limit_s: float):
    """What is wrong with a test's markers, given its cost; None when nothing is."""
    if kids >= process_s and not marks & set(PROCESS_OK):
        return (f"it started processes that used {kids:.1f} s of CPU (a torch-importing process "
                f"costs {process_s:g} s or more) but has no cost marker: mark it "
                f"@pytest.mark.process (or slow/distributed)")
    if cpu + kids > limit_s and not marks & set(SLOW_OK):
        return (f"it cost {cpu + kids:.1f} s of CPU ({kids:.1f} s in processes it started), "
                f"over the {limit_s:g} s an unmarked test may: mark it @pytest.mark.slow")
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when != "call":
        return
    report = outcome.get_result()
    wall, cpu, kids = _meter.totals()
    marks = _marks(item)
    _log(item.config, {"id": item.nodeid, "wall": round(wall, 3), "cpu": round(cpu, 3),
                       "kids": round(kids, 3), "marks": sorted(marks & {*PROCESS_OK, "gpu"}),
                       "end": round(time.time(), 3)})
    if not report.passed:
        return
    wrong = verdict(marks, cpu, kids, float(item.config.getini("kfvision_process_cpu_s")),
                    float(item.config.getini("kfvision_unmarked_cpu_s")))
    if not wrong:
        return
    wrong = f"{item.nodeid}: {wrong} (docs/development.md, \"Test tiers and markers\")"
    check = item.config.getini("kfvision_cost_check")
    if check == "fail" or (check == PROCESSES_FAIL and "mark.process" in wrong):
        report.outcome, report.longrepr = "failed", wrong
    else:  # carried by the report, so that pytest-xdist's controller sees it too
        report.user_properties.append((WARNING, wrong))


WARNING = "kfvision_cost"
# fail a test that started a torch process unmarked (what it started is its own), list one over
# the CPU limit: a test's own CPU depends on what its worker ran before it (the first in a process
# to take a fused step, import a module or compile pays for the others: 11 s against 2 s)
PROCESSES_FAIL = "fail-process"
_unmarked = []  # kfvision_cost_check = "warn": what the run found, said at its end


def pytest_runtest_logreport(report):
    """Collect the "warn" verdicts (in the process that reports: xdist's controller, or the only
    one)."""
    _unmarked.extend(text for key, text in report.user_properties if key == WARNING)


def pytest_sessionfinish(session):
    """The process's whole cost (collection, every fixture's teardown and servers reaped
    included): the line the per-test and per-fixture lines are read against."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _log(session.config, {"process": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                          "cpu": round(usage.ru_utime + usage.ru_stime, 3),
                          "kids": round(_children_cpu(), 3)})


def pytest_terminal_summary(terminalreporter):
    if _unmarked:
        terminalreporter.section("tests that cost more than their markers allow")
        for line in _unmarked:
            terminalreporter.write_line(line)

