"""The units of work pytest-xdist hands out (`make test`: `-n 2 --dist loadfile`).

Under plain `loadfile` a file is one unit: a file of 30 quick tests and 8 jobs held one worker
while the other had run out of work. Here a heavy test (slow, distributed) is a unit of its
own unless it shares a module- or class-scoped fixture with its file; every other test goes
with its file (its module fixtures made once), or with every test that asks for the same
server of ONE_SERVER. The first worker writes the units to a file the controller's scheduler
reads (xdist's own `--dist loadgroup` tags a test's group through `item._nodeid`, which pytest
9.2 no longer reads, so it cannot carry them).
"""

import json
import os
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

UNITS_FILE = "KFVISION_XDIST_UNITS"  # set by the controller, inherited by the workers
# session servers a worker starts for the tests that ask (`kfvision serve`: a torch process)
ONE_SERVER = ("served_digits",)


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
        if heavy(item) and not wide:
            units[item] = item.nodeid
        else:  # the files that speak to the served model share its worker, and one server
            units[item] = next((f for f in ONE_SERVER if f in item.fixturenames), file)
    return units


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
