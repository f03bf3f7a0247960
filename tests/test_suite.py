"""The markers by cost (tests/helpers/cost.py): what an unmarked test may cost, measured."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.cost import _Meter, verdict
from helpers.workunits import HeavyAloneScheduling, work_units


def test_a_cheap_unmarked_test_passes_and_a_costly_one_is_told_its_marker():
    assert verdict(set(), cpu=0.4, kids=0.2, process_s=1.0, limit_s=5) is None
    assert "mark.process" in verdict(set(), cpu=0.4, kids=2.5, process_s=1.0, limit_s=5)
    assert "mark.slow" in verdict(set(), cpu=5.5, kids=0.0, process_s=1.0, limit_s=5)
    assert "mark.slow" in verdict({"process"}, cpu=1.0, kids=4.5, process_s=1.0, limit_s=5)
    assert verdict({"process"}, cpu=1.0, kids=3.0, process_s=1.0, limit_s=5) is None
    assert verdict({"slow"}, cpu=30.0, kids=0.0, process_s=1.0, limit_s=5) is None
    assert verdict({"distributed"}, cpu=1.0, kids=40.0, process_s=1.0, limit_s=5) is None


@pytest.mark.process
def test_the_meter_sees_the_cpu_of_a_process_that_imports_torch_and_not_of_a_bare_one(
        pytestconfig):
    """What the check counts: a bare Python process stays far under the threshold, one that
    imports torch reaches it (marked `process`: this test starts one)."""
    threshold = float(pytestconfig.getini("kfvision_process_cpu_s"))
    meter = _Meter()
    meter.start()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert meter.totals()[2] < threshold / 4
    meter.start()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    assert meter.totals()[2] >= threshold



@pytest.mark.process  # a pytest of its own: no torch, but a second or two of CPU all the same
def test_a_test_that_costs_more_than_its_markers_allow_fails_saying_which_marker(pytester,
                                                                               monkeypatch):
    """The check at work in a pytest run of its own, its limits made tiny: a bare process and
    a short busy loop stand in for a torch process and a slow test."""
    ini = """
        [pytest]
        kfvision_process_cpu_s = 0.005
        kfvision_unmarked_cpu_s = 0.3
        markers =
            process: p
            slow: s
    """
    pytester.makeini(ini)
    pytester.makepyfile("""
        import subprocess, sys, time
        import pytest

        def spin():
            end = time.process_time() + 0.6
            while time.process_time() < end:
                pass

        def test_cheap():
            pass

        def test_starts_a_process():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        @pytest.mark.process
        def test_starts_a_process_marked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_spins():
            spin()

        @pytest.mark.slow
        def test_spins_marked():
            spin()
    """)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # helpers.cost
    result = pytester.runpytest_subprocess("-p", "helpers.cost", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(["*test_starts_a_process: it started processes*mark.process*",
                                 "*test_spins: it cost*mark.slow*"])
    # "fail-process", in two pytest-xdist workers: the process fails, the CPU is listed by the
    # controller at the end (what "warn" does with both)
    pytester.makeini(ini + "    kfvision_cost_check = fail-process\n")
    result = pytester.runpytest_subprocess("-p", "helpers.cost", "-p", "no:cacheprovider",
                                           "-n", "2")
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(["*test_starts_a_process: it started processes*mark.process*"])
    result.stdout.fnmatch_lines(["*tests that cost more than their markers allow*",
                                 "*test_spins: it cost*mark.slow*"])



def test_a_heavy_test_is_a_unit_of_its_own_unless_it_shares_a_module_fixture(pytester):
    """The units pytest-xdist hands out (helpers/workunits.py), on a file of each kind of test."""
    items = pytester.getitems("""
        import pytest

        @pytest.fixture(scope="module")
        def shared():
            return 1

        def test_quick():
            pass

        @pytest.mark.slow
        def test_heavy():
            pass

        @pytest.mark.distributed
        def test_heavy_sharing(shared):
            pass

        def test_asks_the_server(served_digits):
            pass
    """)
    units = {item.name: unit for item, unit in work_units(items).items()}
    file = items[0].nodeid.split("::")[0]
    assert units == {"test_quick": file, "test_heavy": f"{file}::test_heavy",
                     "test_heavy_sharing": file, "test_asks_the_server": "served_digits"}


class _Worker:
    """A FAKE pytest-xdist worker (the scheduler's side of it: what it was sent), so the
    scheduler's bookkeeping runs without starting processes."""

    def __init__(self, name):
        self.gateway = SimpleNamespace(id=name)
        self.sent, self.done, self.shutting_down = [], 0, False

    def send_runtest_some(self, indexes):
        self.sent.append(list(indexes))

    def shutdown(self):
        self.shutting_down = True


def test_a_crashed_worker_leaves_no_finished_unit_to_hand_out_and_every_worker_is_shut_down():
    """A worker dies after finishing one file and halfway through the next; its replacement
    must get only the tests left, and every worker its shutdown (xdist 3.8.0 alone handed out
    the finished file again, as an empty unit, and waited forever)."""
    config = SimpleNamespace(getvalue=lambda name: ["2*popen"],
                             option=SimpleNamespace(loadscopereorder=False))
    sched = HeavyAloneScheduling(config)
    sched._units = {}
    tests = [f"tests/test_{f}.py::test_{n}" for f in "abcd" for n in range(3)]
    a, b = _Worker("gw0"), _Worker("gw1")
    for w in (a, b):
        sched.add_node(w)
        sched.add_node_collection(w, tests)
    sched.schedule()

    def sent(worker):
        return [i for batch in worker.sent for i in batch]

    def run(worker, n):  # the worker runs its next n tests of what it was sent (so far)
        for _ in range(n):
            if worker.done < len(sent(worker)):
                sched.mark_test_complete(worker, sent(worker)[worker.done])
                worker.done += 1

    run(a, 4)  # gw0: its first file, and the first test of another
    assert sched.remove_node(a) == tests[sent(a)[4]]
    c = _Worker("gw2")
    sched.add_node(c)
    sched.add_node_collection(c, tests)
    sched.schedule()
    for _ in range(len(tests)):
        for w in (b, c):
            run(w, 1)
    assert all(batch for w in (b, c) for batch in w.sent), "a unit with no test was sent"
    assert b.shutting_down and c.shutting_down and sched.tests_finished
    # every test ran once to its end: gw0's 4 there, the rest (its crash item again: xdist's
    # way) on the others
    assert sorted(sent(a)[:4] + sent(b) + sent(c)) == list(range(len(tests)))
