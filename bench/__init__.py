"""Throughput benchmarks: kfvision against the usual hand-written way, as ratios in one run."""
