"""A program that has imported torch exits without walking torch's objects again.

torch, torchvision and what torchvision imports at module level (`torch._dynamo`, sympy) leave a
few hundred thousand Python objects that live as long as the process. CPython's cyclic garbage
collector walks every one of them in each full collection, and the interpreter's shutdown runs
several, which costs a process that has imported torch and torchvision most of a second of CPU
(the figures: docs/benchmarks.md#start-and-exit-of-kfvisions-programs). Every trainer,
launcher, `kfvision` command and pipeline step paid it, a job's trainers before torchrun could
see them end.

`gc.freeze` moves every object that exists into a generation that no collection walks. What
changes is only what a collection frees: an object frozen inside a reference cycle that later
becomes garbage stays in memory for the rest of the process. Hence:

- `freeze_imports()`: at a program's entry (`python -m kfvision.trainer.train`, `python -m
  kfvision.trainer.launch`), once its modules are imported and before it makes anything of its own.
  The objects frozen are the modules' own, which live until exit anyway; the full collections during
  the run then walk only what the run made. Never in a function a host process (a notebook,
  `kfvision tune run`) calls: the host's later garbage is not ours to keep.
- `freeze_at_exit()`: at exit, one collection first, so that every cycle of garbage there is is
  finalized as it always was (its objects' `__del__` run; tests/trainer/test_heap.py), then a
  freeze, so that the shutdown's own collections skip the heap. It changes nothing before exit, so a
  function a host calls may ask for it (`kfvision`'s main, a pipeline step). Registered once,
  when first asked for, it runs after every exit handler registered later (atexit: last in,
  first out).
"""

import atexit
import gc


def freeze_imports() -> None:
    """Freeze what the program's imports made, and do the same at exit (module doc).

    No collection first: after the imports one would find a few dozen objects of garbage among
    a few hundred thousand, at a cost docs/benchmarks.md#start-and-exit-of-kfvisions-programs
    gives; those few stay in memory instead."""
    gc.freeze()
    freeze_at_exit()


def _collect_then_freeze() -> None:
    gc.collect()
    gc.freeze()


def freeze_at_exit() -> None:
    """At exit: collect, then freeze (module doc). Registered once per process, where it was
    first asked for."""
    global _registered
    if not _registered:
        atexit.register(_collect_then_freeze)
        _registered = True


_registered = False
