"""A fetch's GETs on obstore (pipelines/clients/s3obstore.py): they go through it, signed with
botocore's credentials; what it cannot check goes through botocore; its failures are botocore's
exceptions, so the named errors are the layer's. (The fault tests, tests/clients/
test_s3_faults.py, fetch through it too.)"""

import hashlib
import socket

import pytest
from botocore import exceptions as bx
from botocore.exceptions import ClientError
from helpers.s3proxy import FaultProxy

from kfvision.pipelines.clients import s3, s3sync
from kfvision.pipelines.clients.s3obstore import Store

MD5 = "0" * 32


def _objects(bucket, n: int) -> dict:
    put = {f"d/{i % 3}/o{i}.bin": bytes([i]) * (100 + i) for i in range(n)}
    for key, data in put.items():
        bucket.put(key, data)
    return put


def test_a_fetch_gets_through_obstore_with_botocores_credentials(s3_bucket, tmp_path,
                                                                 monkeypatch):
    put = _objects(s3_bucket, 6)
    s3_bucket.put("d/a b/ü+x=1~%.bin", b"odd")  # a key that needs escaping
    monkeypatch.setenv("AWS_SESSION_TOKEN", "a-session-token")
    with FaultProxy(s3_bucket.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        s3.reset_clients()
        got = s3sync.fetch(s3_bucket.uri("d/"), tmp_path / "f", progress=False)
    assert got.fetched_objects == len(put) + 1
    assert (tmp_path / "f" / "a b" / "ü+x=1~%.bin").read_bytes() == b"odd"
    assert proxy.clients["GET", "object_store"] == len(put) + 1  # the listing: botocore's
    assert proxy.tokens["object_store", "a-session-token"] == len(put) + 1


@pytest.mark.parametrize("key, etag, takes", [
    ("photos/1/img_0001.jpg", MD5, True),
    ("a b/ü+x=1~%.jpg", MD5, True),
    ("big/model.pt", MD5[:30] + "-3", False),  # a multipart upload's: botocore checks its CRC
    ("a//b.jpg", MD5, False),  # names obstore's paths cannot hold
    ("./a.jpg", MD5, False),
    ("a/../b.jpg", MD5, False),
    ("/a.jpg", MD5, False),
    ("dir/", MD5, False),
])
def test_what_obstore_does_not_check_goes_through_botocore(key, etag, takes):
    assert Store(None, "http://127.0.0.1:1/b/").takes(key, etag) is takes


def test_a_multipart_object_is_fetched_by_botocore(s3_bucket, tmp_path, monkeypatch):
    from kfvision.pipelines.clients import s3put

    monkeypatch.setattr(s3put, "SINGLE_PUT", 5 << 20)  # S3's smallest part
    data = bytes(range(256)) * ((5 << 20) // 256 + 10)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    s3put.upload(src, s3_bucket.name, "m/big.bin")
    with FaultProxy(s3_bucket.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        s3.reset_clients()
        got = s3sync.fetch(s3_bucket.uri("m/"), tmp_path / "f", progress=False)
    assert "-" in got.etags["big.bin"] and (tmp_path / "f" / "big.bin").read_bytes() == data
    assert proxy.clients["GET", "object_store"] == 0


def _store(url: str, bucket: str = "bkt") -> Store:
    """A store of `bucket` at `url` (moto checks no signature: any credentials do)."""
    from botocore.credentials import Credentials

    store = Store.make(s3.client(), bucket, (f"{url}/{bucket}/", "", {}, "us-east-1", "s3"),
                       Credentials("id", "secret"), s3.retry_policy(), 2)
    assert store is not None
    return store


def test_a_refused_connection_and_a_failed_handshake_are_botocores_errors(s3_bucket):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(bx.EndpointConnectionError):
        _store(f"http://127.0.0.1:{port}").get_object("k", f'"{MD5}"')
    with pytest.raises(bx.SSLError):  # https to the plain-http test server
        _store(s3_bucket.endpoint.replace("http:", "https:")).get_object("k", f'"{MD5}"')


# obstore's text of a GET whose body a reset cut short (seen in a run of test_s3_faults.py: it was
# read as a failed handshake, kind: Connect..., and not retried)
BODY_RESET = """Generic S3 error: HTTP error: request or response body error

Debug source:
Generic { store: "S3", source: HttpError { kind: Interrupted, source: reqwest::Error { kind: Body,
source: hyper::Error(Body, Os { code: 104, kind: ConnectionReset, message: "Connection reset by
peer" }) } } }"""


def test_a_body_cut_short_is_botocores_streaming_error_and_retried(s3_bucket):
    """A reset after the headers and half the body, on the server (FaultProxy) and as obstore's
    text of one: botocore's ResponseStreamingError, which the layer retries, never a TLS error."""
    from helpers.s3proxy import Rule

    store = _store(s3_bucket.endpoint, s3_bucket.name)
    assert isinstance(store.botocore(Exception(BODY_RESET)), bx.ResponseStreamingError)
    s3_bucket.put("k", b"x" * 100_000)
    etag = hashlib.md5(b"x" * 100_000).hexdigest()
    with FaultProxy(s3_bucket.endpoint, Rule(rate=1.0, methods={"GET"}, kinds=("reset",))) as p:
        body = _store(p.url, s3_bucket.name).get_object("k", f'"{etag}"')["Body"]
        with pytest.raises(bx.ResponseStreamingError):
            b"".join(body.iter_chunks(1024))


def test_answers_are_botocores_client_errors(s3_bucket):
    s3_bucket.put("k", b"data")
    store = _store(s3_bucket.endpoint, s3_bucket.name)
    etag = hashlib.md5(b"data").hexdigest()
    assert b"".join(store.get_object("k", f'"{etag}"')["Body"].iter_chunks(4)) == b"data"
    for key, match, code in (("k", f'"{MD5}"', "PreconditionFailed"), ("nope", "*", "NoSuchKey")):
        with pytest.raises(ClientError) as e:
            store.get_object(key, match)
        assert e.value.response["Error"]["Code"] == code


def test_credentials_that_cannot_be_had_are_botocores_error(s3_bucket):
    class Expired:  # botocore's refreshable credentials whose refresh fails
        def get_frozen_credentials(self):
            raise bx.CredentialRetrievalError(provider="sts", error_msg="token expired")

    store = Store.make(s3.client(), s3_bucket.name,
                       (f"{s3_bucket.endpoint}/{s3_bucket.name}/", "", {}, "us-east-1", "s3"),
                       Expired(), s3.retry_policy(), 2)
    with pytest.raises(bx.CredentialRetrievalError):
        store.get_object("k", f'"{MD5}"')
