"""Throughput benchmarks: kfvision against the usual hand-written way, as ratios in one run."""

from pathlib import Path

BENCH = Path("build/bench")  # every benchmark's data and results


def publish(text: str, name: str) -> None:
    """Print a benchmark's result and keep it as BENCH/<name>."""
    print("\n" + text)
    BENCH.mkdir(parents=True, exist_ok=True)
    (BENCH / name).write_text(text + "\n")
