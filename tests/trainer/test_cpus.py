"""How many cores a process may use (a container's CPU quota, its affinity) and each process's
share: what the built-in trainer and a script's pod size their threads from."""

import os

import pytest

from kfvision.trainer.cpus import cgroup_cpu_limit, per_process, usable_cpus


@pytest.mark.parametrize("content, expected", [
    ("max 100000\n", None), ("150000 100000\n", 1.5), ("400000 100000\n", 4.0), ("garbage", None)])
def test_a_container_cpu_quota_is_read_from_cgroup_v2(tmp_path, content, expected):
    (tmp_path / "cpu.max").write_text(content)
    assert cgroup_cpu_limit(str(tmp_path / "cpu.max")) == expected


def test_usable_cores_are_the_affinity_at_most_the_quota_whole_and_at_least_one(tmp_path):
    cores = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("max 100000\n")
    assert usable_cpus(str(cpu_max)) == cores
    cpu_max.write_text("150000 100000\n")  # 1.5 cores: one whole core
    assert usable_cpus(str(cpu_max)) == 1
    cpu_max.write_text("50000 100000\n")  # half a core still runs one thread
    assert usable_cpus(str(cpu_max)) == 1
    assert usable_cpus(str(tmp_path / "none")) == cores  # no cgroup v2 file: the affinity


@pytest.mark.parametrize("cores, processes, each", [
    (16, 1, 16), (16, 2, 8), (16, 3, 5), (6, 4, 1), (2, 3, 1), (1, 1, 1), (8, 0, 8)])
def test_each_process_gets_its_share_of_the_cores_and_at_least_one(cores, processes, each):
    assert per_process(processes, cores) == each
