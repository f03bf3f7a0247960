"""`--runtime auto`: which runtime runs a kfvision model directory's fp32 network on this CPU.

Two runtimes can run it in fp32 with the same numerics (softmax probabilities within float32
rounding of each other): PyTorch (`inference_net`: batch norms folded, channels-last) and
OpenVINO's CPU plugin (the network converted once with `ov.convert_model`; OpenVINO fuses
convolution, batch norm and ReLU and has its own AVX2 and AVX-512 kernels). Which is faster
depends on the CPU, so it is measured, not written down: a short probe times both on the model
itself, at batch 1 and at the server's batch size, on the server's threads, alternating, and
OpenVINO is chosen only where its forward is at least MARGIN faster: a forward pass alone
flatters it against what the server then serves (docs/benchmarks.md), and PyTorch reproduces
`kfvision score`'s arithmetic exactly. The probe's result is cached per machine and model
(`cache/probe/<key>.json`, the key: the model's hash, the CPU as `cpu_features` sees it,
threads, batch sizes, library versions), and so is the converted network
(`cache/ir/<model hash>/`): a restart reads both and converts nothing. `kfvision serve` takes it
with `--runtime auto` (not its default: docs/serving.md, "How the runtime is chosen").
"""

import dataclasses
import hashlib
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from trainer.model.arch import SPEC_FILE, WEIGHTS_FILE
from trainer.model.trained import MODEL_FILE

# OpenVINO is chosen when its forward alone is at least this much faster than PyTorch's: in the
# server, where decoding and HTTP share the cores, its passes cost more than alone (a forward
# 1.39x PyTorch's served 0.43-0.62x of PyTorch's images/s at 4-16 clients: docs/benchmarks.md)
MARGIN = 2.0
PROBE_BATCH = 8  # the largest batch the probe times (besides 1): what 4-16 clients make
ROUNDS = 5  # timed passes per runtime and batch size, alternating; the median ratio counts
IR_KEPT = 4  # converted networks kept in the cache (the least recently used go first)
PROBES_KEPT = 64  # probe records kept (each a few hundred bytes)
PROBE_VERSION = 2  # bump when the probe changes what it measures: old records are ignored


@dataclasses.dataclass(frozen=True)
class RuntimeChoice:
    """The runtime `auto` chose and why (for the start-up line, /metrics and describe())."""

    runtime: str
    reason: str
    speedup: float | None = None  # PyTorch's forward time / OpenVINO's, where probed
    cached: bool = False


def model_hash(model_dir) -> str:
    """sha256 of the files that make a trained model directory's network (spec, model.json,
    weights): the same network on any path, a retrained one never."""
    h = hashlib.sha256()
    for name in (SPEC_FILE, MODEL_FILE, WEIGHTS_FILE):
        h.update(name.encode())
        with open(Path(model_dir) / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def ir_folder(cache: Path | None, digest: str, version: str) -> Path | None:
    """Where the network of the model with hash `digest` converted by OpenVINO `version` is kept
    (None: no cache)."""
    if cache is None:
        return None
    return cache / "ir" / f"{digest[:32]}-{version.split('-')[0]}"


def prune(root: Path, keep: int | None = None) -> None:
    """Keep the `keep` (IR_KEPT) most recently used entries of a cache folder: tests and
    retraining make new hashes, and a server's cache should not grow with them."""
    keep = IR_KEPT if keep is None else keep
    entries = sorted((p for p in root.iterdir() if not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def probe_key(digest: str, cpu, threads: int, batches: tuple, version: str) -> str:
    """The probe record's name: what the measured ratio depends on (`version`: OpenVINO's)."""
    facts = {"model": digest, "cpu": cpu.model, "flags": sorted(cpu.flags),
             "isa_cap": cpu.isa_cap, "cores": cpu.cores, "threads": threads,
             "batches": list(batches), "torch": torch.__version__,
             "openvino": version, "probe": PROBE_VERSION}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def probe_batches(batch: int) -> tuple:
    """The batch sizes the probe times: 1 (a lone client) and the server's, at most
    PROBE_BATCH."""
    return tuple(sorted({1, max(1, min(batch, PROBE_BATCH))}))


def measure(runs: dict, image_size: int, batches: tuple, rounds: int = ROUNDS) -> dict:
    """{batch: median over rounds of torch's time / openvino's} for runs {"torch": f,
    "openvino": f} (f: uint8 batch -> probabilities), each round timing one pass of each, the
    order alternating; one pass of each first, untimed (first-call allocations).

    Timed on a thread of its own, as the server runs its forward passes (its forward pool): on
    the main thread PyTorch's OpenMP passes ran 5-30x slower than on any other thread on a
    loaded 2-core machine (docs/serving.md), which would make the probe choose for the wrong
    thread."""
    with ThreadPoolExecutor(1, thread_name_prefix="probe") as pool:
        return pool.submit(_measure, runs, image_size, batches, rounds).result()


def _measure(runs: dict, image_size: int, batches: tuple, rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ratios = {}
    for b in batches:
        x = torch.randint(0, 256, (b, 3, image_size, image_size), dtype=torch.uint8, generator=g)
        for run in runs.values():
            run(x)
        per_round = []
        for r in range(rounds):
            seconds = {}
            for name in (("torch", "openvino") if r % 2 == 0 else ("openvino", "torch")):
                start = time.perf_counter()
                runs[name](x)
                seconds[name] = time.perf_counter() - start
            per_round.append(seconds["torch"] / max(seconds["openvino"], 1e-9))
        ratios[b] = statistics.median(per_round)
    return ratios


def decide(ratios: dict, cpu_kind: str, seconds: float, cached: bool) -> RuntimeChoice:
    """The runtime for measured `ratios` (geometric mean over batch sizes against MARGIN)."""
    speedup = math.exp(statistics.fmean(math.log(r) for r in ratios.values()))
    at = ", ".join(f"{b}: {r:.2f}x" for b, r in ratios.items())
    runtime = "openvino" if speedup >= MARGIN else "torch"
    verdict = (f"OpenVINO fp32 {speedup:.2f}x PyTorch's forward" if runtime == "openvino" else
               f"OpenVINO fp32 only {speedup:.2f}x PyTorch's forward (< {MARGIN}x)")
    how = "cached probe" if cached else f"probed in {seconds:.1f} s"
    return RuntimeChoice(runtime, f"auto: {verdict} on this CPU ({cpu_kind}; per batch {at}; "
                         f"{how})", round(speedup, 3), cached)


def read_probe(cache: Path | None, key: str) -> dict | None:
    """A probe's record from the cache, None when there is none (or it cannot be read)."""
    if cache is None:
        return None
    try:
        record = json.loads((cache / "probe" / f"{key}.json").read_text())
        return record if record.get("probe") == PROBE_VERSION else None
    except (OSError, ValueError):
        return None


def write_probe(cache: Path | None, key: str, record: dict) -> None:
    """Store a probe's record (atomically; an unwritable cache only costs the next start a
    probe)."""
    if cache is None:
        return
    folder = cache / "probe"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, folder / f"{key}.json")
        prune(folder, PROBES_KEPT)
    except OSError:
        pass


def choose(digest: str, image_size: int, torch_run, openvino_run, *, version: str | None,
           threads: int, batch: int, cache: Path | None) -> tuple[RuntimeChoice, object]:
    """(the choice, its run: uint8 batch -> probabilities) for the kfvision model directory
    whose `model_hash` is `digest`.

    `torch_run` runs the network as PyTorch serves it; `openvino_run(folder)` gives OpenVINO's
    run, its network read from `folder` where it was converted before, else converted (and
    stored there; `folder` None: not stored). `version`: OpenVINO's, None where it is not
    installed. A cached probe for this machine and model decides without converting anything
    when it chose PyTorch; where OpenVINO cannot convert the network, PyTorch serves (the reason
    says so).
    """
    from trainer.fastpath import cpu_features

    if version is None:  # openvino is an optional dependency of a bare install
        return RuntimeChoice("torch", "auto: PyTorch (OpenVINO is not installed)"), torch_run
    cpu = cpu_features()
    batches = probe_batches(batch)
    key = probe_key(digest, cpu, threads, batches, version)
    record = read_probe(cache, key)
    if record is not None:
        choice = decide({int(b): r for b, r in record["ratios"].items()}, cpu.kind,
                        record["seconds"], cached=True)
        if choice.runtime == "torch":
            return choice, torch_run
    folder = ir_folder(cache, digest, version)
    how = "read" if folder is not None and (folder / "model.xml").is_file() else "converted"
    start = time.perf_counter()
    try:
        ov_run = openvino_run(folder)
    except Exception as e:  # the converter raises many types; PyTorch still serves the model
        return RuntimeChoice("torch", f"auto: PyTorch (OpenVINO could not convert the network: "
                             f"{type(e).__name__}: {str(e)[:200]})"), torch_run
    converted = time.perf_counter() - start
    if record is None:
        ratios = measure({"torch": torch_run, "openvino": ov_run}, image_size, batches)
        seconds = time.perf_counter() - start - converted
        write_probe(cache, key, {"probe": PROBE_VERSION, "ratios": ratios, "seconds": seconds,
                                 "threads": threads, "cpu": cpu.to_dict(),
                                 "model_hash": digest})
        choice = decide(ratios, cpu.kind, seconds, cached=False)
    choice = dataclasses.replace(choice, reason=f"{choice.reason}; OpenVINO's network {how} "
                                 f"in {converted:.1f} s")
    return choice, ov_run if choice.runtime == "openvino" else torch_run
