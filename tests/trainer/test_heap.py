"""Programs freeze the heap at exit (trainer/heap.py) without losing a finalizer that runs today.

How much faster they exit is measured, not tested: `python -m bench.startup` (docs/benchmarks.md).
"""

import subprocess
import sys
import textwrap

import pytest
from helpers.paths import REPO

# A reference cycle with a finalizer, made garbage before exit: CPython finalizes it in its
# shutdown collection. What the program does first is {setup}.
CYCLE = """
    import atexit, gc, sys
    {setup}
    class Holder:
        def __del__(self):
            with open(sys.argv[1], "a") as f:
                f.write("finalized")
    h = Holder()
    h.me = h
    del h
"""


def _finalized(tmp_path, setup: str) -> str:
    script, out = tmp_path / "cycle.py", tmp_path / "out.txt"
    script.write_text(textwrap.dedent(CYCLE).format(setup=setup))
    run = subprocess.run([sys.executable, str(script), str(out)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return out.read_text() if out.exists() else ""


@pytest.mark.parametrize("setup", [
    "",  # what Python does by itself
    "from kfvision.trainer.heap import freeze_imports; freeze_imports()",
    "from kfvision.trainer.heap import freeze_at_exit; freeze_at_exit()",
])
def test_garbage_made_before_exit_is_finalized_as_without_the_freeze(tmp_path, setup):
    assert _finalized(tmp_path, setup) == "finalized"


def test_a_bare_freeze_at_exit_would_lose_that_finalizer(tmp_path):
    # why kfvision.trainer.heap collects before it freezes: the test above can fail
    assert _finalized(tmp_path, "atexit.register(gc.freeze)") == ""


# Each program's entry, run as its command runs it; a handler registered before anything else
# runs after every other one (atexit: last in, first out) and prints whether the heap is frozen.
ENTRIES = {
    "kfvision": ("kfvision.pipelines.cli", ["--help"]),
    "trainer": ("kfvision.trainer.train", ["--help"]),
    "launcher": ("kfvision.trainer.launch", ["--help"]),
}
PROBE = """
import atexit, gc, runpy, sys
atexit.register(lambda: print("frozen objects:", gc.get_freeze_count()))
"""


def _frozen_at_exit(code: str) -> int:
    run = subprocess.run([sys.executable, "-c", PROBE + code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return int(run.stdout.rsplit("frozen objects:", 1)[1])


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_every_program_exits_with_its_heap_frozen(entry):
    module, args = ENTRIES[entry]
    code = f"sys.argv = [{module!r}, *{args!r}]\nrunpy.run_module({module!r}, run_name='__main__')"
    assert _frozen_at_exit(code) > 0


def test_a_pipeline_step_exits_with_its_heap_frozen():
    assert _frozen_at_exit("from kfvision.pipelines.flow.steps.common import run\n"
                           "run(print, 'step')") > 0
