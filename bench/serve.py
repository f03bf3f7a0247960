"""Serving throughput: `kfvision serve` against a plain hand-written server, on the work users
send: a matrix of image sizes x concurrent clients, every cell measured, the baseline in the same
run.

The plain server (bench/plain_server.py) is what a tutorial writes: stdlib HTTP, PIL decode,
torchvision resize / crop / normalise, one forward per request on a thread per connection.
`kfvision serve` is KServe's model server with score's decoding (JPEGs at reduced size where the
resize allows) on threads and concurrent requests batched into shared forward passes. With
`--runtimes` it also serves the model's ONNX export (`onnx`) and its int8 export (`int8`).

Every contender serves the same ResNet-18 (224 px, ImageNet evaluation preset), trained for 3
epochs on 480 generated ImageNet-size JPEGs of 10 classes (`trained_model`, once, cached; about
2 minutes on 2 cores): throughput does not depend on the weights, but the int8 export's accuracy
check needs a model that has learnt something. It serves clients that each send one v1 request
with one image at a time, back to back, over a kept-alive connection, for `--seconds`, at 1, 4
and 16 clients (and, for overload, 64 and 256: `--clients 16 64 256`). A client refused with 503
(kfvision's full queue) waits the Retry-After it was given, counts the refusal and sends again;
latencies and images/s count accepted requests only, and the overload table holds each
contender's accepted images/s and p99 at more clients to its own at 16 (goal: images/s at least
as high, p99 at most 3x, no errors besides the refusals). The
images (bench/jpegset.py, generated) come in three sizes (`SIZES`): 256 px thumbnails,
ImageNet-size JPEGs (about 500x375, quality 90, ~100 KB) and 12-megapixel phone photos
(4032x3024, 3.5 MB). A round measures every cell once, the contenders' order alternating between
rounds; ratios (contender / plain) are taken within a round and the table gives their median and
range over rounds. Beside images per second it gives p50, p99 and images per CPU-second of the
server process, which the machine's other load changes far less (the load averages before and
after are printed with the table). The goal column checks the bar kfvision serve is held to
(a server built for this work must beat a plain one where it counts): at least 1.5x the
plain server's images/s at 4 and 16 clients, at least 1.0x at 1 client, a p99 no worse (int8:
at least 2.5x at 16 clients).

On a machine with more cores than the server should have, `--server-cpus 0-1` pins every
server to those cores and the clients to the others, so the load generator (a thread per client,
in this process) takes no CPU from the server: what a 2-core serving pod sees with its clients
elsewhere. Without it, clients and servers share the machine's cores.

    python -m bench.serve [--rounds 3 --seconds 10 --sizes thumbnail imagenet photo
                           --clients 1 4 16 --runtimes torch int8 --server-cpus 0-1]
"""

import argparse
import base64
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import bench
from bench.jpegset import PHOTO, make_jpeg_set
from kfvision.pipelines.clients.endpoints import free_port
from kfvision.pipelines.serve.client import Server, request
from kfvision.trainer.model.arch import build_model, write_untrained_model
from kfvision.trainer.model.spec import WEIGHTS_FILE, read_model_spec
from kfvision.trainer.model.trained import atomic_torch_save, write_model_files

BENCH = bench.BENCH / "serve"


def bench_model(out: Path, classes: int = 10, size: int = 224) -> Path:
    """A trained model directory: ResNet-18, random weights (seed 0), 224 px, standard preset."""
    if (out / WEIGHTS_FILE).is_file():
        return out
    write_untrained_model(out, "resnet18")
    torch.manual_seed(0)
    spec = read_model_spec(out)
    info = {"arch": "resnet18", "classes": [f"class_{i:02d}" for i in range(classes)],
            "image_size": size, "eval_preset": "standard",
            "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    write_model_files(out, spec, info, {"bench": "random weights"})
    atomic_torch_save(build_model(spec, classes).state_dict(), out / WEIGHTS_FILE)
    return out


class Plain:
    """bench/plain_server.py in its own process."""

    def __init__(self, model: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/predict"
        with log.open("wb") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "bench.plain_server", "--model",
                                          str(model), "--port", str(self.port)],
                                         stdout=f, stderr=subprocess.STDOUT)
        for _ in range(600):
            try:
                if request(f"http://127.0.0.1:{self.port}/", timeout=2)[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the plain server did not start; see {log}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


class Kfvision:
    """`kfvision serve` in its own process (the model directory, or its ONNX export)."""

    def __init__(self, model: Path, log: Path, extra: list):
        self.server = Server(["--model", model, "--name", "bench", *extra], log)
        self.url = f"{self.server.url}/v1/models/bench:predict"

    @property
    def pid(self) -> int:
        return self.server.proc.pid

    def stop(self):
        self.server.stop()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(url: str, bodies: list[bytes], clients: int, seconds: float, pid: int) -> dict:
    """`clients` threads posting `bodies` in turn for `seconds`: images/s, p50 and p99 in ms,
    and images per CPU-second of the server process (what the machine's other load cannot
    change much: a busy shared machine gives a process a share of the cores, not of the work)."""
    host, port = url.split("/")[2].split(":")
    path = "/" + url.split("/", 3)[3]
    latencies, errors, refused = [], [], []
    deadline = time.perf_counter() + seconds

    def client(k: int):
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        i = k
        while time.perf_counter() < deadline:
            start, retry = time.perf_counter(), None
            try:
                conn.request("POST", path, bodies[i % len(bodies)],
                             {"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                ok = r.status == 200
                if r.status == 503 and r.getheader("Retry-After"):
                    retry = float(r.getheader("Retry-After"))
            except OSError:  # counted, and the client reconnects
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=300)
                ok = False
            if retry is not None:  # the documented refusal: wait as told, then send again
                refused.append(retry)
                time.sleep(max(0.0, min(retry, deadline - time.perf_counter())))
                continue
            (latencies if ok else errors).append(time.perf_counter() - start)
            i += 1
        conn.close()

    start, cpu = time.perf_counter(), cpu_seconds(pid)
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    lat = sorted(latencies) or [float("nan")]
    return {"images_per_s": len(latencies) / elapsed,
            "images_per_cpu_s": len(latencies) / max(cpu, 1e-9),
            "p50_ms": 1000 * lat[len(lat) // 2],
            "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "requests": len(latencies), "errors": len(errors), "refused": len(refused)}


# name: (size passed to make_jpeg_set, what the table calls it)
SIZES = {"thumbnail": ((256, 192), "256x192 thumbnails"),
         "imagenet": (None, "ImageNet-size JPEGs (about 500x375)"),
         "photo": (PHOTO, f"{PHOTO[0]}x{PHOTO[1]} photos")}
# the goal, contender / plain images/s: at 1 client (no worse), at 4 and 16 (batching across
# requests must pay), int8 at 16 and more
GOAL_ONE, GOAL_MANY, GOAL_INT8 = 1.0, 1.5, 2.5


def _images(size: str, n: int) -> list[bytes]:
    root = BENCH / f"jpeg-{size}" / str(n)
    make_jpeg_set(root, images=n, classes=10, size=SIZES[size][0])
    return [f.read_bytes() for f in sorted((root / "raw").rglob("*.jpg"))]


def _body(image: bytes) -> bytes:
    return json.dumps({"instances": [{"image": {"b64": base64.b64encode(image).decode()}}]}
                      ).encode()


def _range(values: list[float], fmt: str = "{:.2f}") -> str:
    return (fmt.format(statistics.median(values)) + " (" + fmt.format(min(values)) + "-"
            + fmt.format(max(values)) + ")")


def goal_met(name: str, clients: int, ratio: float, p99_ratio: float) -> bool:
    """The bar for one cell: images/s ratio (median over rounds) and plain p99 / p99.
    int8's bar is 2.5x at 16 clients; elsewhere it is held to kfvision's."""
    if clients == 1:
        want = GOAL_ONE
    else:
        want = GOAL_INT8 if name == "kfvision-int8" and clients >= 16 else GOAL_MANY
    return ratio >= want and p99_ratio >= 1.0


def table(results: dict, names: list, sizes: list, clients: list) -> str:
    """Markdown: a row per image size, clients and contender: median (range) over rounds of
    images/s, p50, p99, images per CPU-second, and the ratios to the plain server in the same
    round; the goal column says whether the cell meets the bar (goal_met)."""
    lines = ["| images | clients | server | images/s | x plain | p50 ms | p99 ms | plain p99 / p99 "
             "| images/CPU-s | x plain images/CPU-s | goal |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for size in sizes:
        for c in clients:
            plain = results[size]["plain"][c]
            for name in names:
                runs = results[size][name][c]
                ratio = [r["images_per_s"] / p["images_per_s"] for r, p in zip(runs, plain)]
                p99 = [p["p99_ms"] / r["p99_ms"] for r, p in zip(runs, plain)]
                cpu = [r["images_per_cpu_s"] / p["images_per_cpu_s"] for r, p in zip(runs, plain)]
                if name == "plain":
                    verdict = ""
                else:
                    met = goal_met(name, c, statistics.median(ratio), statistics.median(p99))
                    verdict = "met" if met else "**not met**"
                lines.append(
                    f"| {size} | {c} | {name} | {_range([r['images_per_s'] for r in runs])} | "
                    f"{_range(ratio)} | {_range([r['p50_ms'] for r in runs], '{:.0f}')} | "
                    f"{_range([r['p99_ms'] for r in runs], '{:.0f}')} | {_range(p99)} | "
                    f"{_range([r['images_per_cpu_s'] for r in runs])} | {_range(cpu)} | "
                    f"{verdict} |")
    return "\n".join(lines)


OVERLOAD_FROM, OVERLOAD_P99 = 16, 3.0  # more clients than this: images/s held, p99 at most 3x


def overload_table(results: dict, names: list, sizes: list, clients: list) -> str:
    """Markdown: each contender at more than 16 clients against itself at 16, in the same round:
    accepted images/s, p99 of accepted requests, refusals and errors (sums over rounds), and
    whether the cell meets the overload goal. '' when the run has no such cells."""
    more = [c for c in clients if c > OVERLOAD_FROM]
    if OVERLOAD_FROM not in clients or not more:
        return ""
    lines = [f"| images | clients | server | accepted images/s | x at {OVERLOAD_FROM} | p99 ms "
             f"(accepted) | x p99 at {OVERLOAD_FROM} | refused | errors | goal |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for size in sizes:
        for c in more:
            for name in names:
                runs, base = results[size][name][c], results[size][name][OVERLOAD_FROM]
                rate = [r["images_per_s"] / b["images_per_s"] for r, b in zip(runs, base)]
                p99 = [r["p99_ms"] / b["p99_ms"] for r, b in zip(runs, base)]
                errors = sum(r["errors"] for r in runs)
                met = (statistics.median(rate) >= 1.0 and statistics.median(p99) <= OVERLOAD_P99
                       and errors == 0)
                lines.append(
                    f"| {size} | {c} | {name} | {_range([r['images_per_s'] for r in runs])} | "
                    f"{_range(rate)} | {_range([r['p99_ms'] for r in runs], '{:.0f}')} | "
                    f"{_range(p99)} | {sum(r.get('refused', 0) for r in runs)} | {errors} | "
                    f"{'met' if met else '**not met**'} |")
    return "\n".join(lines)


def trained_model(out: Path = BENCH / "trained") -> tuple[Path, Path, Path]:
    """(model directory, train images, check images): ResNet-18 at 224 px trained with
    `kfvision.trainer.train` on 600 generated ImageNet-size JPEGs (480 train, 120 val), 3 epochs;
    the
    check images are 500 more of the same classes (another seed), for int8's accuracy check."""
    from kfvision.trainer.data.split import split

    data = out / "data"
    model = out / "resnet18-224"
    check = make_jpeg_set(out / "check", images=500, seed=2)
    if (model / WEIGHTS_FILE).is_file() and (model / "model.json").is_file():
        return model, data / "train", check
    images = make_jpeg_set(out / "jpeg", images=600)
    if not (data / "val").exists():
        split(images, data / "train", data / "val", fraction=0.8, seed=1)
    base = out / "untrained"
    if not base.exists():
        write_untrained_model(base, "resnet18")
    print(f"training the benchmark's ResNet-18 (3 epochs, 480 images) into {model}", flush=True)
    run = subprocess.run(
        [sys.executable, "-m", "kfvision.trainer.train", "--model", str(base), "--train",
         str(data / "train"), "--val", str(data / "val"), "--out", str(model), "--epochs", "3",
         "--image-size", "224", "--batch-size", "16", "--lr", "0.05", "--patience", "3",
         "--print-freq", "100000"], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"kfvision train failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return model, data / "train", check


def int8_model(model: Path, train: Path, check: Path) -> tuple[Path, dict]:
    """(path, its `quantization` metadata): `kfvision export --quantize int8` of `model`,
    calibrated on `train`, its top-1 checked on `check` against fp32; made once, cached."""
    from kfvision.trainer.fastpath import int8_reduce_range
    from kfvision.trainer.use.quantize import export_int8

    # one per weight width: an export for a CPU with VNNI is refused on one without
    out = BENCH / f"resnet18-224-int8-{7 if int8_reduce_range() else 8}bit.onnx"
    meta_file = out.with_suffix(".json")
    if not (out.is_file() and meta_file.is_file()):
        meta = export_int8(model, out, train, check)
        meta_file.write_text(json.dumps(meta["quantization"], indent=1))
    return out, json.loads(meta_file.read_text())


def _sources(model: Path, runtimes: list, train: Path, check: Path) -> tuple[dict, str]:
    """({contender name: model path} for the runtimes asked for, the int8 export's accuracy
    for the table's heading ('' without int8))."""
    sources, accuracy = {}, ""
    if "torch" in runtimes:
        sources["kfvision"] = model
    if "onnx" in runtimes:
        from kfvision.trainer.use.export import export

        onnx = BENCH / "resnet18-224.onnx"
        if not onnx.is_file():
            export(model, "onnx", onnx)
        sources["kfvision-onnx"] = onnx
    if "int8" in runtimes:
        sources["kfvision-int8"], q = int8_model(model, train, check)
        accuracy = (f" kfvision-int8's top-1 on {q['val_images']} held-out images: "
                    f"{q['top1_int8']:.2%} against {q['top1_fp32']:.2%} in fp32 (the same model; "
                    f"calibrated on {q['calibration_images']} training images).")
        print(accuracy.strip(), flush=True)
    return sources, accuracy


def cpu_list(text: str) -> set[int]:
    """"0-1,4" -> {0, 1, 4}, as taskset and cgroups write CPU lists."""
    cpus = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def pin(server_cpus: str | None) -> str:
    """Pin this process to `server_cpus` (the servers it starts next inherit them) and say where
    servers and clients run; `split_off_clients` then moves this process to the other CPUs."""
    if not server_cpus:
        return f"servers and clients share {len(os.sched_getaffinity(0))} CPUs"
    mine, wanted = os.sched_getaffinity(0), cpu_list(server_cpus)
    if not wanted < mine:
        raise SystemExit(f"--server-cpus {server_cpus}: this process may use CPUs "
                         f"{sorted(mine)}; name a part of them, leaving some for the clients")
    os.sched_setaffinity(0, wanted)
    return (f"servers pinned to {len(wanted)} CPUs ({server_cpus}), clients on the other "
            f"{len(mine - wanted)}")


def split_off_clients(server_cpus: str | None, allowed: set) -> None:
    """Move this process (its client threads start later) off the servers' CPUs."""
    if server_cpus:
        os.sched_setaffinity(0, allowed - cpu_list(server_cpus))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=12, help="distinct images of each size")
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--seconds", type=float, default=10, help="per cell and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runtimes", nargs="+", choices=("torch", "onnx", "int8"),
                   default=["torch"])
    p.add_argument("--serve-args", default="", help="more `kfvision serve` flags, one string")
    p.add_argument("--untrained", action="store_true",
                   help="serve random weights (`bench_model`): no training first; not with int8")
    p.add_argument("--variants", nargs="*", default=[], metavar="NAME=FLAGS",
                   help="more kfvision contenders (PyTorch runtime) with these serve flags, "
                   "e.g. 's2=--model-streams 2 --model-threads 1'")
    p.add_argument("--server-cpus", metavar="LIST",
                   help="pin the servers to these CPUs (e.g. 0-1) and the clients to the rest")
    a = p.parse_args(argv)
    BENCH.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    if a.untrained and "int8" in a.runtimes:
        p.error("--untrained serves random weights; int8's accuracy check needs the trained model")
    model, train, check = ((bench_model(BENCH / "untrained-224"), None, None) if a.untrained
                           else trained_model())
    bodies = {size: [_body(b) for b in _images(size, a.images)] for size in a.sizes}
    allowed = os.sched_getaffinity(0)
    placement = pin(a.server_cpus)
    servers = {"plain": Plain(model, BENCH / "plain.log")}
    sources, accuracy = _sources(model, a.runtimes, train, check)
    servers.update({n: Kfvision(m, BENCH / f"{n}.log", a.serve_args.split())
                    for n, m in sources.items()})
    for v in a.variants:
        n, _, flags = v.partition("=")
        servers[f"kfvision-{n}"] = Kfvision(model, BENCH / f"kfvision-{n}.log",
                                            (a.serve_args + " " + flags).split())
    split_off_clients(a.server_cpus, allowed)
    names = list(servers)
    load_before = os.getloadavg()[0]
    results = {size: {n: {c: [] for c in a.clients} for n in names} for size in a.sizes}
    cells = len(a.sizes) * len(a.clients) * len(names)
    print(f"{a.rounds} rounds of {cells} cells, {a.seconds:g} s each: about "
          f"{a.rounds * cells * a.seconds / 60:.0f} minutes", flush=True)
    try:
        for s in servers.values():  # warm-up: first requests pay for allocations
            for size in a.sizes:
                load(s.url, bodies[size], 2, 2, s.pid)
        for r in range(a.rounds):
            for size in a.sizes:
                for c in a.clients:
                    for n in (names if r % 2 == 0 else names[::-1]):
                        res = load(servers[n].url, bodies[size], c, a.seconds, servers[n].pid)
                        results[size][n][c].append(res)
                        print(f"round {r + 1} {size:9s} {n:14s} {c:2d} clients: "
                              f"{res['images_per_s']:6.2f} images/s  p50 {res['p50_ms']:6.0f} ms"
                              f"  p99 {res['p99_ms']:6.0f} ms  {res['images_per_cpu_s']:5.2f} "
                              f"images/CPU-s  ({res['requests']} requests, {res['errors']} "
                              f"errors, {res['refused']} refused)", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    text = (f"Serving ResNet-18 (224 px), one image per v1 request; median (range) over "
            f"{a.rounds} rounds of {a.seconds:g} s per cell; "
            f"{os.cpu_count()} CPUs ({placement}), load average {load_before:.1f} before, "
            f"{os.getloadavg()[0]:.1f} after. Images: "
            + "; ".join(f"{k}: {SIZES[k][1]}" for k in a.sizes) + "." + accuracy
            + "\n\n"
            + table(results, [n for n in names if n != "plain"] + ["plain"], a.sizes,
                    a.clients))
    overload = overload_table(results, [n for n in names if n != "plain"] + ["plain"], a.sizes,
                              a.clients)
    if overload:
        text += "\n\nOverload, each server against itself at 16 clients:\n\n" + overload
    bench.publish(text, "serve/serve.md")
    (BENCH / "serve.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
