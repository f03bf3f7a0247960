"""Serving throughput: `kfvision serve` against a plain hand-written server, same model and images.

The plain server (bench/plain_server.py) is what a tutorial writes: stdlib HTTP, PIL decode,
torchvision resize / crop / normalise, one forward per request. `kfvision serve` is KServe's model
server with score's decoding (JPEGs at reduced size where the resize allows) on threads and
concurrent requests batched into shared forward passes; with `--runtimes torch onnx` it runs
twice, on the trained model directory and on its ONNX export.

Every contender serves the same ResNet-18 (224 px, ImageNet evaluation preset; random weights:
throughput does not depend on them) to clients that each send one v1 request with one image at
a time, back to back, over a kept-alive connection, for `--seconds`, at 1, 4 and 16 clients. The
images are generated camera photos (4032x3024 JPEGs, bench/jpegset.py) or, with `--small`,
ImageNet-sized ones. Rounds alternate the contenders' order; ratios (kfvision / plain) are taken
within a round and the table gives their median and range over rounds. Beside images per second
it gives images per CPU-second of the server process, which the machine's other load changes
far less (the load averages before and after are printed with the table).

    python -m bench.serve [--rounds 3 --seconds 15 --clients 1 4 16 --runtimes torch onnx]
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
from pipelines.serve.client import Server, free_port, request
from trainer.model.arch import WEIGHTS_FILE, build_model, read_model_spec, write_untrained_model
from trainer.model.trained import atomic_torch_save, write_model_files

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
    latencies, errors = [], []
    deadline = time.perf_counter() + seconds

    def client(k: int):
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        i = k
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            try:
                conn.request("POST", path, bodies[i % len(bodies)],
                             {"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                ok = r.status == 200
            except OSError:  # counted, and the client reconnects
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=300)
                ok = False
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
    lat = sorted(latencies)
    return {"images_per_s": len(lat) / elapsed, "images_per_cpu_s": len(lat) / max(cpu, 1e-9),
            "p50_ms": 1000 * lat[len(lat) // 2],
            "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "requests": len(lat), "errors": len(errors)}


def _photos(n: int, small: bool) -> list[bytes]:
    root = BENCH / ("jpeg-small" if small else "jpeg-photo") / str(n)
    make_jpeg_set(root, images=n, classes=10, size=None if small else PHOTO)
    return [f.read_bytes() for f in sorted((root / "raw").rglob("*.jpg"))]


def _body(image: bytes) -> bytes:
    return json.dumps({"instances": [{"image": {"b64": base64.b64encode(image).decode()}}]}
                      ).encode()


def _range(values: list[float], fmt: str = "{:.2f}") -> str:
    return (fmt.format(statistics.median(values)) + " (" + fmt.format(min(values)) + "-"
            + fmt.format(max(values)) + ")")


def table(results: dict, names: list, clients: list) -> str:
    """Markdown: per contender and clients, median (range) of images/s, p50, p99; ratios."""
    lines = ["| server | clients | images/s | p50 ms | p99 ms | x plain images/s | "
             "plain p99 / p99 | images/CPU-s | x plain images/CPU-s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        for c in clients:
            runs = results[name][c]
            plain = results["plain"][c]
            ratio = [r["images_per_s"] / p["images_per_s"] for r, p in zip(runs, plain)]
            p99 = [p["p99_ms"] / r["p99_ms"] for r, p in zip(runs, plain)]
            per_cpu = [r["images_per_cpu_s"] for r in runs]
            cpu_ratio = [r / p["images_per_cpu_s"] for r, p in zip(per_cpu, plain)]
            lines.append(f"| {name} | {c} | {_range([r['images_per_s'] for r in runs])} | "
                         f"{_range([r['p50_ms'] for r in runs], '{:.0f}')} | "
                         f"{_range([r['p99_ms'] for r in runs], '{:.0f}')} | "
                         f"{_range(ratio)} | {_range(p99)} | {_range(per_cpu)} | "
                         f"{_range(cpu_ratio)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=12, help="distinct images the clients send")
    p.add_argument("--small", action="store_true", help="ImageNet-sized JPEGs, not photos")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--seconds", type=float, default=15)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runtimes", nargs="+", choices=("torch", "onnx"), default=["torch"])
    p.add_argument("--serve-args", default="", help="more `kfvision serve` flags, one string")
    p.add_argument("--variants", nargs="*", default=[], metavar="NAME=FLAGS",
                   help="more kfvision contenders (PyTorch runtime) with these serve flags, "
                   "e.g. 'w8=--workers 8'")
    a = p.parse_args(argv)
    BENCH.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    model = bench_model(BENCH / "resnet18-224")
    bodies = [_body(b) for b in _photos(a.images, a.small)]
    sources = {"kfvision": model}
    if "onnx" in a.runtimes:
        from trainer.use.export import export

        onnx = BENCH / "resnet18-224.onnx"
        if not onnx.is_file():
            export(model, "onnx", onnx)
        sources["kfvision-onnx"] = onnx
        if "torch" not in a.runtimes:
            del sources["kfvision"]
    servers = {"plain": Plain(model, BENCH / "plain.log")}
    servers.update({n: Kfvision(m, BENCH / f"{n}.log", a.serve_args.split())
                    for n, m in sources.items()})
    for v in a.variants:
        n, _, flags = v.partition("=")
        servers[f"kfvision-{n}"] = Kfvision(model, BENCH / f"kfvision-{n}.log",
                                            (a.serve_args + " " + flags).split())
    names = list(servers)
    load_before = os.getloadavg()[0]
    results = {n: {c: [] for c in a.clients} for n in names}
    try:
        for s in servers.values():  # warm-up: first requests pay for allocations
            load(s.url, bodies, 2, 3, s.pid)
        for r in range(a.rounds):
            for c in a.clients:
                for n in (names if r % 2 == 0 else names[::-1]):
                    res = load(servers[n].url, bodies, c, a.seconds, servers[n].pid)
                    results[n][c].append(res)
                    print(f"round {r + 1} {n:14s} {c:2d} clients: "
                          f"{res['images_per_s']:6.2f} images/s  p50 {res['p50_ms']:6.0f} ms  "
                          f"p99 {res['p99_ms']:6.0f} ms  {res['images_per_cpu_s']:5.2f} images/"
                          f"CPU-s  ({res['requests']} requests, "
                          f"{res['errors']} errors)", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    size = "ImageNet-sized" if a.small else f"{PHOTO[0]}x{PHOTO[1]}"
    text = (f"Serving ResNet-18 (224 px) on {size} JPEGs, one image per request; median (range) "
            f"over {a.rounds} rounds of {a.seconds:g} s; {os.cpu_count()} CPUs, load average "
            f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n\n"
            + table(results, [n for n in names if n != "plain"] + ["plain"], a.clients))
    print("\n" + text)
    (BENCH / "serve.md").write_text(text + "\n")
    (BENCH / "serve.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
