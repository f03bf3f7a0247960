"""Throughput benchmarks: kfvision against the usual hand-written way, as ratios in one run."""

from pathlib import Path

BENCH = Path("build/bench")  # every benchmark's data and results


def processor() -> str:
    """The processor a figure was measured on: model, kind (AVX2 only, AVX-512, AVX512_BF16,
    AMX), the flags the speed choices read, and an ONEDNN_MAX_CPU_ISA cap where one is set."""
    from kfvision.trainer.fastpath import (
        describe_cpu,  # imports torch: only once a benchmark is done
    )

    return describe_cpu()


def publish(text: str, name: str) -> None:
    """Print a benchmark's result, with the processor it ran on, and keep it as BENCH/<name>."""
    text = f"{text}\n\n{processor()}"
    print("\n" + text)
    BENCH.mkdir(parents=True, exist_ok=True)
    (BENCH / name).write_text(text + "\n")
