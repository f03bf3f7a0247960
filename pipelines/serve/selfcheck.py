"""What the pipeline's deploy step runs, as ordinary functions (the KFP component is a thin shell).

Locally the step starts `kfvision serve` on a free port, sends the validation images through the
v1 and v2 protocols, checks the served labels equal the scored ones, and stops the server
(`serve_and_check`). Whether to deploy at all is the gate the register step shares
(kfvision.pipelines.flow.steps.common.accuracy_gate).
"""

import csv
import time
from pathlib import Path

from kfvision.pipelines.serve.client import Server, request, v1_body, v2_body
from kfvision.trainer.errors import KfvisionError

CHUNK = 16  # images per request (under the server's per-request limit)


class ServedLabelsDifferError(KfvisionError):
    """The served labels are not the scored labels for the same images."""

    exit_code = 1


def _post(url: str, body: bytes) -> dict:
    status, answer = request(url, body)
    if status != 200:
        raise ServedLabelsDifferError(f"the server answered {status} to {url}: {answer}")
    return answer


def serve_and_check(model_dir, data_dir, scored_csv, log, name: str = "model") -> dict:
    """Serve `model_dir` locally, send every image `scored_csv` lists (paths in the image
    directory `data_dir`) through v1 and v2, and compare with the table's `scored_label`.
    Returns the figures.

    Raises:
        ServedLabelsDifferError: a served label differs from the scored one, or a request failed.
        ChangedDatasetError: an image changed since the directory was made.
    """
    from kfvision.trainer.data.imagedir import read_image_directory

    with Path(scored_csv).open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    imdir = read_image_directory(data_dir, verify="none")
    entries = {e.path: e for e in imdir.images}
    files = []
    for r in rows:
        e = entries[r["image"]]
        files.append(imdir.file(e).read_bytes())
        imdir.check_bytes(e, files[-1])
    start = time.perf_counter()
    server = Server(["--model", model_dir, "--name", name], log)
    started = time.perf_counter() - start
    try:
        served, seconds = {"v1": [], "v2": []}, {}
        for protocol in served:
            start = time.perf_counter()
            for i in range(0, len(files), CHUNK):
                part = files[i:i + CHUNK]
                if protocol == "v1":
                    answer = _post(f"{server.url}/v1/models/{name}:predict", v1_body(part))
                    served["v1"] += [p["label"] for p in answer["predictions"]]
                else:
                    answer = _post(f"{server.url}/v2/models/{name}/infer", v2_body(part))
                    out = {o["name"]: o for o in answer["outputs"]}
                    served["v2"] += out["label"]["data"]
            seconds[protocol] = time.perf_counter() - start
    finally:
        server.stop()
    figures = {"images": len(files), "server_start_s": round(started, 3)}
    for protocol, labels in served.items():
        figures[f"{protocol}_labels_equal_scored"] = check_labels(protocol, labels, rows,
                                                                  scored_csv, log)
        figures[f"{protocol}_images_per_s"] = round(len(files) / seconds[protocol], 3)
    return figures


def check_labels(protocol: str, labels: list, rows: list, scored_csv, log) -> int:
    """How many `labels` (served over `protocol`, in the order of the table's `rows`) there are,
    once each equals its row's `scored_label`.

    Raises:
        ServedLabelsDifferError: one differs, or there are not as many.
    """
    scored = [r["scored_label"] for r in rows]
    differ = [rows[i]["image"] for i, (a, b) in enumerate(zip(labels, scored)) if a != b]
    if differ or len(labels) != len(scored):
        raise ServedLabelsDifferError(
            f"{protocol}: {len(differ)} of {len(scored)} served labels differ from "
            f"{scored_csv} (first: {differ[:3]}); the server's log is {log}.")
    return len(labels)
