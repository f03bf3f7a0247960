#!/usr/bin/env bash
# The GPU benchmark (issue 6) in one command, on a machine with a CUDA GPU:
#
#     bash bench/gpu.sh
#
# Needs only a Python with torch, torchvision, pillow and numpy: no .venv, no network, no kfp,
# PyYAML, tqdm or scikit-learn. PYTHON picks the interpreter (default: python3); extra arguments
# go to bench.train and win over the ones below (e.g. --images 10000 --epochs 5).
#
# ResNet-50, 224 px, batch 256, standard augmentation, on 5,000 generated ImageNet-like JPEGs
# (generated once into build/bench/jpeg5000, about 2 minutes on one core): the plain
# ImageFolder + PIL loop with 8 DataLoader workers against `kfvision train` with its defaults and
# with --gpu-decode on. Training images/s with data loading included, epochs after the first,
# and each contender's whole run in seconds (process start to exit: start-up and epoch 1 too).
# The table is printed and written to build/bench/train-jpeg-cuda.md.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m bench.train --dataset jpeg --device cuda --images 5000 \
    --archs resnet50 --image-size 224 --batch-size 256 --epochs 4 --rounds 1 \
    --plain-workers 8 "$@"
