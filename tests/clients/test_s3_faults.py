"""Object storage that misbehaves: fetching, pushing and the model cache through a proxy
(tests/helpers/s3proxy.py) that throttles, resets, truncates, stalls and answers with a stale ETag,
in front of the loopback moto server (tests/conftest.py). Each ends with the right bytes, or, once
the retry budget is spent, a named error (exit 69) whose journal a rerun resumes from."""

import dataclasses
import json
import random
import time
from pathlib import Path

import pytest
from helpers.s3proxy import KINDS, PART_1, FaultProxy, Rule

from kfvision.pipelines.cli import main
from kfvision.pipelines.clients import s3, s3put, s3sync
from kfvision.trainer.data.imagedir import MANIFEST


@pytest.fixture
def proxy(s3_bucket, monkeypatch):
    """A fault proxy (faulting nothing yet) in front of the test server, and every client made
    from now on talking through it; `s3_bucket.client` still talks to the server itself."""
    with FaultProxy(s3_bucket.endpoint, seed=1, stall_s=1.0) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        s3.reset_clients()
        yield p


@pytest.fixture
def policy():
    """Set a retry policy for the test (helpers.s3bucket.FAST_RETRIES, changed as given)."""
    from helpers.s3bucket import FAST_RETRIES

    def use(**changes):
        s3.set_retry_policy(dataclasses.replace(FAST_RETRIES, **changes))

    yield use
    s3.set_retry_policy(FAST_RETRIES)


def _objects(bucket, prefix: str, n: int, seed: int = 0) -> dict:
    """n small objects of random bytes (50 B - 3 KiB) under prefix, put on the server itself."""
    rng, put = random.Random(seed), {}
    for i in range(n):
        data = rng.randbytes(rng.randint(50, 3072))
        key = f"{prefix}{i % 10}/obj-{i:05d}.bin"
        bucket.put(key, data)
        put[key[len(prefix):]] = data
    return put


def _files(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and not p.name.startswith(".")}


def _journal(folder: Path) -> set:
    lines = (folder / s3sync.JOURNAL).read_text().splitlines()[1:]
    return {json.loads(line)["path"] for line in lines}


@pytest.mark.parametrize("kind", KINDS)
def test_each_fault_alone_is_retried_to_the_right_bytes(s3_bucket, proxy, policy, tmp_path,
                                                        kind):
    if kind == "stall":  # a stalled body (3 s) is a failed try; a slow one on a loaded machine not
        proxy.stall_s = 3.0
        policy(read_timeout_s=1.0)
    put = _objects(s3_bucket, "d/", 30)
    proxy.rule = Rule(rate=0.3, methods={"GET"}, kinds=(kind,))
    got = s3sync.fetch(s3_bucket.uri("d/"), tmp_path / "f", max_connections=4, progress=False)
    assert proxy.faults[kind] >= 3, proxy.faults
    assert _files(tmp_path / "f") == put and got.fetched_objects == 30
    assert not list((tmp_path / "f").rglob(f"{s3.PART}*"))


@pytest.mark.slow
# 1,000 objects: five times the objects at the same fault rate (stress); 200 meet every kind
@pytest.mark.parametrize("n", [200, pytest.param(1000, marks=pytest.mark.stress)])
def test_a_fetch_with_a_tenth_of_requests_faulted_equals_a_clean_one(s3_bucket, proxy, tmp_path,
                                                                     n):
    put = _objects(s3_bucket, "many/", n)
    start = time.monotonic()
    clean = s3sync.fetch(s3_bucket.uri("many/"), tmp_path / "clean", progress=False)
    print(f"{n} objects, clean: {time.monotonic() - start:.1f} s")
    proxy.rule = Rule(rate=0.1, methods={"GET", "HEAD"},
                      kinds=("slowdown", "reset", "truncate", "stale_etag"))
    start = time.monotonic()
    faulted = s3sync.fetch(s3_bucket.uri("many/"), tmp_path / "faulted", progress=False)
    print(f"{n} objects, {sum(proxy.faults.values())} faults {dict(proxy.faults)}: "
          f"{time.monotonic() - start:.1f} s")
    assert sum(proxy.faults.values()) >= n // 20
    assert _files(tmp_path / "faulted") == _files(tmp_path / "clean") == put
    assert faulted.etags == clean.etags and faulted.fetched_objects == n


def test_a_spent_budget_is_exit_69_and_the_rerun_fetches_only_the_rest(
        s3_bucket, proxy, policy, tiny_digits, tmp_path, capsys):
    policy(attempts=3)
    n = s3_bucket.upload_folder(tiny_digits["raw"] / "val", "v/")
    sevens = len(list((tiny_digits["raw"] / "val" / "7").iterdir()))
    proxy.rule = Rule(rate=1.0, methods={"GET"}, kinds=("truncate",), path=r"/v/7/")
    out, place = tmp_path / "val", tmp_path / "val.fetched"
    rc = main(["convert", s3_bucket.uri("v/"), str(out), "--quiet", "--max-connections", "2"])
    err = capsys.readouterr().err
    assert rc == 69, err
    assert err.startswith("error: ObjectTransferError: ") and err.count("\n") == 1, err
    assert "/v/7/" in err and "on the last of 3 tries" in err, err
    assert not out.exists()
    done = _journal(place)
    assert done and not any(p.startswith("7/") for p in done)  # nothing truncated is journaled
    assert not list(place.glob("7/*")) and not list(place.rglob(f"{s3.PART}*"))
    assert all((place / p).is_file() for p in done)
    proxy.rule = Rule()
    rc = main(["convert", s3_bucket.uri("v/"), str(out), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0 and f"downloaded {n - len(done)} " in text, text
    assert n - len(done) >= sevens
    assert len(json.loads((out / MANIFEST).read_text())["images"]) == n


def test_the_budget_bounds_the_total_time(s3_bucket, proxy, policy, tmp_path):
    policy(attempts=1000, base_s=0.05, cap_s=0.05, total_s=1.0)
    _objects(s3_bucket, "d/", 1)
    proxy.rule = Rule(rate=1.0, methods={"GET", "HEAD"}, kinds=("slowdown",))
    start = time.monotonic()
    with pytest.raises(s3.ObjectTransferError, match=r"HTTP 503 SlowDown, on the last of \d+ "
                       r"tr(y|ies) over \d\.\d s") as e:
        s3sync.fetch(s3_bucket.uri("d/"), tmp_path / "f", progress=False)
    assert time.monotonic() - start < 6 and e.value.exit_code == 69  # not 1,000 tries


def test_backoff_is_full_jitter_below_an_exponential_cap():
    p = s3.RetryPolicy(base_s=0.1, cap_s=1.0)
    for n, top in [(0, 0.1), (1, 0.2), (3, 0.8), (4, 1.0), (12, 1.0)]:
        waits = [p.wait(n) for _ in range(200)]
        assert all(0 <= w <= top for w in waits) and max(waits) > top / 2


def test_a_push_through_faults_writes_the_right_bytes(s3_bucket, proxy, tmp_path):
    folder = tmp_path / "model"
    rng = random.Random(3)
    for i in range(40):
        (folder / f"part-{i % 4}").mkdir(parents=True, exist_ok=True)
        (folder / f"part-{i % 4}" / f"f{i}.bin").write_bytes(rng.randbytes(rng.randint(1, 4000)))
    proxy.rule = Rule(rate=0.3, methods={"PUT"}, kinds=("slowdown", "reset", "truncate",
                                                         "stale_etag"))
    keys = s3sync.push(folder, s3_bucket.uri("pushed/"), max_connections=4)
    assert sum(proxy.faults.values()) >= 5, proxy.faults
    assert len(keys) == 40
    for p in folder.rglob("*.bin"):
        key = "pushed/" + p.relative_to(folder).as_posix()
        assert s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read() \
            == p.read_bytes()


def _uploads(bucket) -> list:
    """The multipart uploads begun and neither completed nor aborted."""
    return bucket.client.list_multipart_uploads(Bucket=bucket.name).get("Uploads", [])


def test_a_multipart_upload_whose_part_answer_is_damaged_sends_that_part_again(
        s3_bucket, proxy, tmp_path):
    """Not by luck: the first answer to every upload's part 1 carries another ETag (boto3's
    transfer manager sent that ETag on and failed at CompleteMultipartUpload: InvalidPart)."""
    big = tmp_path / "weights.pt"
    big.write_bytes(random.Random(5).randbytes(12 << 20))  # two parts: 8 MiB and 4 MiB
    proxy.rule = Rule(rate=1.0, methods={"PUT"}, kinds=("stale_etag",), path=PART_1, first=True)
    s3put.upload(big, s3_bucket.name, "model/weights.pt")
    assert proxy.faults == {"stale_etag": 1}
    got = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key="model/weights.pt")
    assert got["Body"].read() == big.read_bytes()
    assert got["ETag"].strip('"') == s3put.local_etag(big) and s3put.local_etag(big).endswith("-2")
    assert _uploads(s3_bucket) == []


def test_multipart_uploads_through_faults_on_every_call_end_whole(s3_bucket, proxy, tmp_path):
    """Throttled, reset, cut-short and damaged answers to the parts' PUTs and to the uploads'
    POSTs (begin, complete): each retried, every file whole, no upload left behind."""
    rng = random.Random(7)
    files = {}
    for i in range(3):
        files[f"ckpt-{i}.pt"] = tmp_path / f"ckpt-{i}.pt"
        files[f"ckpt-{i}.pt"].write_bytes(rng.randbytes((9 + i) << 20))
    proxy.rule = (Rule(rate=1.0, methods={"PUT"}, kinds=("stale_etag",), path=PART_1,
                       first=True),
                  Rule(rate=0.3, methods={"PUT", "POST"}, kinds=("slowdown", "reset",
                                                                 "truncate", "stale_etag")))
    for name, path in files.items():
        s3put.upload(path, s3_bucket.name, f"ckpt/{name}", max_connections=2)
    assert proxy.by_rule[0] == 3 and proxy.by_rule[1] >= 1, proxy.by_rule
    for name, path in files.items():
        got = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=f"ckpt/{name}")
        assert got["Body"].read() == path.read_bytes(), name
    assert _uploads(s3_bucket) == []


def test_the_model_cache_resumes_after_a_spent_budget(s3_bucket, proxy, policy, tmp_path):
    policy(attempts=2)
    put = _objects(s3_bucket, "models/m/", 20)
    proxy.rule = Rule(rate=1.0, methods={"GET"}, kinds=("reset",), path=r"/models/m/3/")
    with pytest.raises(s3.ObjectTransferError):
        s3sync.fetch_model(s3_bucket.uri("models/m/"), cache=tmp_path / "cache")
    partial = next((tmp_path / "cache").rglob(".*.partial"))
    done = _journal(partial)
    assert done and not any(p.startswith("3/") for p in done)
    assert [p.name for p in partial.parent.iterdir() if not p.name.startswith(".")] == []
    proxy.rule = Rule(rate=0.2, methods={"GET"}, kinds=("truncate", "stale_etag"))
    policy()
    local = s3sync.fetch_model(s3_bucket.uri("models/m/"), cache=tmp_path / "cache")
    assert _files(local) == put and not partial.exists()
    assert s3sync.fetch_model(s3_bucket.uri("models/m/"), cache=tmp_path / "cache") == local


def test_a_slowdown_pauses_every_call_of_the_process_for_its_backoff():
    """One call told 503 SlowDown waits its backoff, and a call of another thread starting
    meanwhile waits it out too: requests in flight back off together."""
    import threading

    from botocore.exceptions import ClientError

    class Fixed(s3.RetryPolicy):
        def wait(self, n: int) -> float:
            return 0.5

    old = s3.set_retry_policy(Fixed())
    told, tries = threading.Event(), []

    def throttled():
        tries.append(time.monotonic())
        if len(tries) == 1:
            told.set()
            raise ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce"},
                               "ResponseMetadata": {"HTTPStatusCode": 503}}, "GetObject")
        return "done"

    try:
        first = threading.Thread(target=s3.retried, args=("s3://b/k", "read", throttled))
        first.start()
        assert told.wait(10)
        other = s3.retried("s3://b/other", "read", time.monotonic)
        first.join(10)
    finally:
        s3.set_retry_policy(old)
    assert len(tries) == 2 and tries[1] - tries[0] >= 0.5
    assert other - tries[0] >= 0.45  # the other call's only try, after the backoff


def test_parts_the_store_refuses_at_completion_start_the_upload_over(s3_bucket, tmp_path,
                                                                      monkeypatch):
    """Where a part's ETag cannot be checked (a store whose ETags are not MD5s, as with KMS) a
    damaged one reaches CompleteMultipartUpload, which the store refuses (InvalidPart): the
    upload is aborted and made again from the start, and ends whole. Here the first upload's
    part 2 is given a wrong ETag on its way to the completion (the stand-in for that answer)."""
    big = tmp_path / "ckpt.pt"
    big.write_bytes(random.Random(9).randbytes(10 << 20))
    real, uploads = s3put._part, []

    def part(client, fd, uri, bucket, key, upload_id, number, offset, length):
        got = real(client, fd, uri, bucket, key, upload_id, number, offset, length)
        if upload_id not in uploads:
            uploads.append(upload_id)
        if number == 2 and upload_id == uploads[0]:
            got = {**got, "ETag": '"' + "0" * 32 + '"', "checked": False}
        return got

    monkeypatch.setattr(s3put, "_part", part)
    s3put.upload(big, s3_bucket.name, "ckpt/ckpt.pt", max_connections=2)
    assert len(uploads) == 2  # refused once, made again
    got = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key="ckpt/ckpt.pt")
    assert got["Body"].read() == big.read_bytes()
    assert _uploads(s3_bucket) == []  # the refused upload was aborted
