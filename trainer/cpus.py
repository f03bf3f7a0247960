"""How many CPU cores this process may use, and each process's share of them.

    threads = per_process(local_world_size)   # usable_cpus() // processes, at least 1

Torch-free on purpose: the built-in trainer sizes its threads and decoding workers from it
(kfvision.trainer.distributed), and so does a user's script's pod before torch is imported
(kfvision.pipelines.script.boot gives each process OMP_NUM_THREADS from it).
"""

import os
from pathlib import Path

CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD", or "max PERIOD" when unlimited


def cgroup_cpu_limit(path: str = CPU_MAX) -> float | None:
    """The container's CPU quota in cores (cgroup v2 `cpu.max`), or None when unlimited/unknown.

    A Kubernetes CPU limit shows up only here: the affinity mask still lists every core of the
    node, and sizing threads and workers from it would oversubscribe the pod's quota.
    """
    try:
        quota, period = Path(path).read_text(encoding="ascii").split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def usable_cpus(cpu_max: str = CPU_MAX) -> int:
    """CPU cores this process may use: the cores it may run on, at most the container's quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cpu_max)
    if limit is not None:
        cores = min(cores, max(1, int(limit)))
    return max(1, cores)


def per_process(processes: int, cores: int | None = None) -> int:
    """Each of `processes` processes' share of `cores` (default: `usable_cpus()`), at least 1."""
    return max(1, (usable_cpus() if cores is None else cores) // max(1, processes))
