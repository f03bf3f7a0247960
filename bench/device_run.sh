#!/usr/bin/env bash
# Everything the GPU work needs measured, in one call on a lent GPU machine (torch, torchvision,
# pytest, PyYAML and scikit-learn there; kfvision not installed; no network; nothing carried but
# the repository):
#
#     bash bench/device_run.sh            # about 9 minutes on one H100: give the call 600 s
#     bash bench/device_run.sh --smoke    # on a CPU, tiny sizes, the GPU tests skipped: a check
#     bash bench/device_run.sh --again    # about 3 minutes: the runs with data again (no step
#                                         # variants, no tests) and a timeline of the default run
#
# 1. `bash bench/gpu.sh --quick`: the step's ceiling (channels-last, CUDA graphs, torch.compile),
#    the plain loop, kfvision's default and the batched GPU pipeline (`--cache off`), with
#    `nvidia-smi dmon` (SM, memory, JPEG engine %) and `vmstat` (CPU %) sampled every second;
# 2. the first epoch's profile (bench/firstepoch.py: cProfile + torch.profiler);
# 3. tests/trainer/test_gpu.py and test_batchcrop.py (the batched pipeline on this machine's
#    torch); the serving tests skip where kserve is absent.
# Each part has its own time limit, and a failed part does not stop the next. The tables are
# printed at the end; the logs and tables go to $OUT (the device tool's folder; else
# build/bench/device-run), at most 8 files.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/importroot.sh
PY="${PYTHON:-python3}"
DEST="${OUT:-build/bench/device-run}"
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
MODE=${1:-}
if [ "$MODE" = "--smoke" ]; then
    DEVICE=cpu; BENCH_ARGS=(--device cpu --smoke --step-variants channels-last --epochs 1)
    PROFILE_ARGS=(--device cpu --images 48 --arch resnet18 --image-size 32 --batch-size 8)
    LIMITS=(900 600 900)  # a loaded 2-core CPU: generous, nothing waits on it
elif [ "$MODE" = "--again" ]; then
    DEVICE=cuda; BENCH_ARGS=(--quick --skip step); PROFILE_ARGS=(--device cuda)
    LIMITS=(170 60 0)
else
    DEVICE=cuda; BENCH_ARGS=(--quick); PROFILE_ARGS=(--device cuda)
    LIMITS=(330 70 170)  # 9.5 minutes in all, the rest of a 600 s call for the start
fi

part() {  # part NAME LIMIT COMMAND...: run with a time limit, log to $DEST/NAME.log
    local name=$1 limit=$2 start rc
    shift 2
    echo "=== $name (at most ${limit} s): $*"
    start=$(date +%s)
    timeout "$limit" "$@" >"$DEST/$name.log" 2>&1
    rc=$?
    echo "=== $name: exit $rc after $(($(date +%s) - start)) s$([ $rc = 124 ] && echo ' (time limit)')"
    [ $rc = 0 ] || tail -n 25 "$DEST/$name.log"
}

{
    date -u
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
        --format=csv,noheader
    "$PY" -c 'import sys, torch, torchvision; print(sys.version.split()[0], torch.__version__,
torchvision.__version__, "cuda", torch.cuda.is_available())'
    nproc
} >"$DEST/machine.txt" 2>&1
cat "$DEST/machine.txt"

monitors=()
if command -v nvidia-smi >/dev/null; then
    nvidia-smi dmon -s u -d 1 -o T >"$DEST/dmon.log" 2>&1 &
    monitors+=($!)
fi
if command -v vmstat >/dev/null; then
    vmstat -t 1 >"$DEST/vmstat.log" 2>&1 &
    monitors+=($!)
fi
part bench "${LIMITS[0]}" bash bench/gpu.sh "${BENCH_ARGS[@]}"
for pid in "${monitors[@]}"; do kill "$pid" 2>/dev/null; done
if [ "$MODE" = "--again" ]; then
    # the default run once more, every step printed, each output line stamped with the seconds
    # since the process started: where the whole run's time goes outside the steps
    part timeline 60 bash -c '"$0" - "$@" <<"EOF"
import subprocess, sys, time
start = time.perf_counter()
run = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
for line in run.stdout:
    print(f"{time.perf_counter() - start:7.2f} {line}", end="", flush=True)
print(f"{time.perf_counter() - start:7.2f} exit {run.wait()}")
EOF' "$PY" "$PY" -m kfvision.trainer.train --model build/bench/models/resnet50 \
        --train build/bench/jpeg2560/train --val build/bench/jpeg2560/val \
        --out build/bench/trained/timeline --augment standard --lr 0.05 --print-freq 1 \
        --patience 3 --device cuda --image-size 224 --batch-size 256 --epochs 3
fi
part firstepoch "${LIMITS[1]}" "$PY" -m bench.firstepoch "${PROFILE_ARGS[@]}"
[ "${LIMITS[2]}" = 0 ] || part tests "${LIMITS[2]}" "$PY" -m pytest -q -p no:cacheprovider \
    tests/trainer/test_gpu.py tests/trainer/test_batchcrop.py

# the tables, in one file and on the output
for f in gpu step train-jpeg; do
    [ -f "build/bench/$f-$DEVICE.md" ] && { echo; cat "build/bench/$f-$DEVICE.md"; }
done >"$DEST/tables.md"
for f in build/bench/firstepoch-*-"$DEVICE".txt; do
    [ -f "$f" ] && cp "$f" "$DEST/firstepoch.txt"
done
echo
cat "$DEST/tables.md"
[ -f "$DEST/firstepoch.txt" ] && sed -n '1,14p' "$DEST/firstepoch.txt"
[ -f "$DEST/timeline.log" ] && grep -vE "^ *[0-9.]+ epoch [0-9]+ \[[2-8]/" "$DEST/timeline.log"
[ -f "$DEST/tests.log" ] && grep -E "passed|failed|error" "$DEST/tests.log" | tail -n 3
true  # the parts report their own exits above
