"""The units of work pytest-xdist hands out (`make test`: `-n 2 --dist loadfile`).

Under plain `loadfile` a file is one unit: a file of 30 quick tests and 8 jobs held one worker
while the other had run out of work. Here a heavy test (slow, distributed) is a unit of its
own unless it shares a module- or class-scoped fixture with its file; every other test goes
with its file (its module fixtures made once); and every test that asks for one of SHARED goes
with the others that do, whatever its file. The first worker writes the units to a file the
controller's scheduler reads (xdist's own `--dist loadgroup` tags a test's group through
`item._nodeid`, which pytest 9.2 no longer reads, so it cannot carry them).
"""

import json
import os
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

UNITS_FILE = "KFVISION_XDIST_UNITS"  # set by the controller, inherited by the workers
# What a worker makes for the tests that ask, and the other worker would make again or wait for:
# a session server (`kfvision serve`: a torch process), and the 2 x 2 job made once a run
# (conftest's made_once: a second worker that asks while the first makes it waits, its core idle
# for the 15-40 s the job takes). Their tests go together, handed out first.
SHARED = ("pytorchjob_2x2", "served_digits")


def heavy(item) -> bool:
    return bool(item.get_closest_marker("slow") or item.get_closest_marker("distributed"))


def work_units(items) -> dict:
    """{item: the name of the unit it goes in}."""
    units = {}
    for item in items:
        file = item.nodeid.split("::")[0]
        info = getattr(item, "_fixtureinfo", None)
        wide = info is not None and any(d.scope in ("module", "class", "package")
                                        for defs in info.name2fixturedefs.values()
                                        for d in defs)
        shared = next((f for f in SHARED if f in item.fixturenames), None)
        if shared:
            units[item] = shared
        elif heavy(item) and not wide:
            units[item] = item.nodeid
        else:
            units[item] = file
    return units


def order(items, units: dict) -> dict:
    """{unit: its place in the hand-out}: the SHARED units, then the heavy tests alone, then the
    units that hold a heavy test, then the rest (within a kind, in collection order)."""
    first = [f for f in SHARED if f in units.values()]
    alone = [units[i] for i in items if units[i] == i.nodeid]
    with_heavy = [units[i] for i in items if heavy(i)]
    return {unit: n for n, unit in enumerate(dict.fromkeys(
        first + alone + with_heavy + [units[i] for i in items]))}


def write_units(units: dict) -> None:
    """On the first worker: the units where the controller will read them."""
    path = os.environ.get(UNITS_FILE)
    if path and os.environ.get("PYTEST_XDIST_WORKER") == "gw0":
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps({item.nodeid: unit for item, unit in units.items()}))
        tmp.replace(path)


class HeavyAloneScheduling(LoadFileScheduling):
    """loadfile, with the units of work_units (a test not found there: its file)."""

    _units = None

    def _split_scope(self, nodeid: str) -> str:
        if self._units is None:
            path = Path(os.environ.get(UNITS_FILE, "/nonexistent"))
            self._units = json.loads(path.read_text()) if path.is_file() else {}
        return self._units.get(nodeid) or super()._split_scope(nodeid)

    def remove_node(self, node):
        # pytest-xdist 3.8.0 puts a crashed worker's units back on the queue whole, the ones it
        # had finished too (xdist/scheduler/loadscope.py, `remove_node`, at v3.8.0;
        # pytest-dev/pytest-xdist#1323, fixed after that release). A finished
        # unit handed out later sends its worker no test, so that worker is never told to shut
        # down and the run waits forever (a worker's crash became a hang until CI's time limit):
        # only the units with a test left go back.
        workload = self.assigned_work.get(node, {})
        for scope in [s for s, unit in workload.items() if all(unit.values())]:
            del workload[scope]
        return super().remove_node(node)
