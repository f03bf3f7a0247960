"""kfvision's Prometheus metrics, served beside KServe's on `/metrics` of the REST port.

KServe's own histograms (`request_predict_seconds` ...) time a whole request; these say where
its time went: decoding each image, and each forward pass with the number of images it carried.
They live in prometheus_client's default registry, the one KServe's `/metrics` writes out.
"""

import time

from prometheus_client import Counter, Gauge, Histogram, Info

DECODE_SECONDS = Histogram(
    "kfvision_decode_seconds", "seconds to decode one image (base64, file, resize) on a "
    "decode thread", ["model_name"])
FORWARD_SECONDS = Histogram(
    "kfvision_forward_seconds", "seconds of one forward pass (one batch)", ["model_name"])
BATCH_IMAGES = Histogram(
    "kfvision_batch_images", "images in one forward pass, across concurrent requests",
    ["model_name"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
REFUSED = Counter(
    "kfvision_refused_requests", "requests refused at once because the queue was full (REST "
    "503 with Retry-After, gRPC RESOURCE_EXHAUSTED)", ["model_name"])
ABANDONED = Counter(
    "kfvision_abandoned_requests", "requests whose client went away before their answer (those "
    "still queued leave the queue: no forward pass for them)", ["model_name"])
MAX_QUEUE = Gauge(
    "kfvision_max_queue_images", "images that may wait for the model (decoding or queued); "
    "beyond it requests are refused; 0: no bound", ["model_name"])

FAST_PATH = Info(
    "kfvision_fast_path", "the CPU the model is served on and the speed choices taken for it "
    "(runtime, threads, precision hint, int8 weights)", ["model_name"])


def timed_decode(decode, model_name: str):
    """`decode` (any arguments), observed in kfvision_decode_seconds."""
    seconds = DECODE_SECONDS.labels(model_name)

    def run(*args):
        start = time.perf_counter()
        try:
            return decode(*args)
        finally:
            seconds.observe(time.perf_counter() - start)
    return run


def timed_forward(forward, model_name: str):
    """`forward` (a batch of images in, one row per image out), observed in
    kfvision_forward_seconds and kfvision_batch_images."""
    seconds, images = FORWARD_SECONDS.labels(model_name), BATCH_IMAGES.labels(model_name)

    def run(batch):
        start = time.perf_counter()
        out = forward(batch)
        seconds.observe(time.perf_counter() - start)
        images.observe(len(batch))
        return out
    return run
