#!/usr/bin/env bash
# The GPU benchmark in one command, on a machine with a CUDA GPU (bench/gpu.py says what it runs):
#
#     bash bench/gpu.sh             # ResNet-50, 224 px, batch 256, bf16: 5,000 JPEGs, 4 epochs
#     bash bench/gpu.sh --quick     # the same rows within one short device call
#     bash bench/gpu.sh --device cpu --smoke   # tiny sizes: checks that every part runs
#
# Needs only a Python with torch, torchvision, pillow and numpy: no .venv, no network, no kfp,
# PyYAML, tqdm or scikit-learn, and no install of kfvision. PYTHON picks the interpreter
# (default: python3); arguments go to bench.gpu. The tables are printed and written to
# build/bench/ (gpu-cuda.md: the summary; step-cuda.md, train-jpeg-cuda.md: the parts).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/importroot.sh
exec "${PYTHON:-python3}" -m bench.gpu "$@"
