"""What runs first in every process of a user's script job, before the script: Python imports
`sitecustomize` at start-up from its path, and the boot puts this folder on the ranks' PYTHONPATH
(pipelines/script/boot.py `rank_env`). It imports nothing of kfvision (a requirements
environment may not have it) and nothing the script would not import itself.

Once per rank process (RANK_HOOK, which it takes out of the environment, so that the processes
the script starts are left alone):
1. stderr is merged into stdout at the source (one file descriptor), so that the rank's log keeps
   the order the process wrote in: torchrun tees a rank's stdout and stderr from two files;
2. Azure ML's argument variables: AZ_BATCHAI_TASK_INDEX (the global rank), beside the boot's
   AZ_BATCHAI_PYTORCH_INIT_METHOD; then `$NAME` and `${NAME}` in the script's arguments are
   expanded from this process's environment, as Azure does per process (`$$` is a literal `$`;
   an unknown name is left as written);
3. when the script's process joins a process group (torch.distributed.init_process_group, which
   accelerate, Lightning, DeviceMesh and Horovod's stand-in all call), a file named by its pid is
   written into GROUP_MARKS: the boot counts them to tell a job whose processes each ran the whole
   script alone.
Then Python's own sitecustomize (if the environment has one) runs, as it would have.
"""

import contextlib
import os
import re
import sys

RANK_HOOK = "KFVISION_RANK_HOOK"
GROUP_MARKS = "KFVISION_GROUP_MARKS"
_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_C10D = "torch.distributed.distributed_c10d"


def expand(text: str, environ) -> str:
    """`text` with $NAME and ${NAME} from `environ`, $$ as $; unknown names left as written."""
    def one(m):
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(2)
        return environ.get(name, m.group(0))

    return _VARIABLE.sub(one, text)


def _mark_groups(marks: str) -> None:
    """Wrap init_process_group as torch.distributed loads, to leave a mark when it returns."""
    import functools
    import importlib.util

    class Watch:
        def find_spec(self, name, path=None, target=None):
            if name != _C10D:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                real = module.init_process_group

                @functools.wraps(real)
                def init_process_group(*args, **kwargs):
                    out = real(*args, **kwargs)
                    with contextlib.suppress(OSError), open(os.path.join(marks,
                                                                         str(os.getpid())), "w"):
                        pass
                    return out

                module.init_process_group = init_process_group

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Watch())


def _rank_start() -> None:
    if os.environ.pop(RANK_HOOK, None) != "1":
        return
    with contextlib.suppress(OSError):
        os.dup2(1, 2)
    if "RANK" in os.environ:
        os.environ.setdefault("AZ_BATCHAI_TASK_INDEX", os.environ["RANK"])
    sys.argv[1:] = [expand(a, os.environ) for a in sys.argv[1:]]
    marks = os.environ.get(GROUP_MARKS)
    if marks:
        _mark_groups(marks)


def _chain() -> None:
    """Import the environment's own sitecustomize, which this module's name hides."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    ours = sys.modules.pop(__name__)
    try:
        import sitecustomize  # noqa: F401
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        sys.modules.setdefault(__name__, ours)


_rank_start()
_chain()
