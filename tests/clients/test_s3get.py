"""The fetch's GetObject without botocore's per-call work (pipelines/clients/s3get.py): its
signature is botocore's, byte for byte; its answers and refusals are what `get_object` gives;
where it cannot make a request (an unsigned client, a redirect) botocore's `get_object` does."""

import datetime

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from helpers.s3proxy import FaultProxy, Rule

from kfvision.pipelines.cli import main
from kfvision.pipelines.clients import s3, s3get

STATIC = {"User-Agent": "Boto3/1.44.5  md/Botocore#1.44.5", "x-amz-checksum-mode": "ENABLED",
          "amz-sdk-request": "attempt=1; max=1"}


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:9000/bucket/photos/1/img_0001.jpg",
    "https://bucket.s3.eu-west-1.amazonaws.com/a%20b/%C3%BC%2Bx%3D1~.jpg",
    "https://s3.us-east-1.amazonaws.com:443/bucket/key?x-id=GetObject",
    "http://[::1]:9000/bucket/k",
])
@pytest.mark.parametrize("token", [None, "session-token/with+chars="])
def test_the_signature_is_botocores(monkeypatch, url, token):
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    frozen = creds.get_frozen_credentials()
    at = datetime.datetime(2026, 11, 26, 10, 7, 57, tzinfo=datetime.timezone.utc)
    monkeypatch.setattr("botocore.auth.get_current_datetime", lambda: at)
    theirs = AWSRequest("GET", url, headers={**STATIC, "If-Match": '"abc"'})
    S3SigV4Auth(frozen, "s3", "eu-west-1").add_auth(theirs)
    signer = s3get.SigV4("eu-west-1", "s3")
    for _ in range(2):  # the second from the cached signing key
        ours = signer.sign(url, {**STATIC, "If-Match": '"abc"'}, frozen, "20261126T100757Z")
        assert ours == {k: v for k, v in theirs.headers.items()}


def _objects(bucket, n: int) -> dict:
    put = {f"d/{i % 3}/o{i}.bin": bytes([i]) * (100 + i) for i in range(n)}
    for key, data in put.items():
        bucket.put(key, data)
    return put


def test_the_answer_is_get_objects(s3_bucket):
    s3_bucket.put("a b/ü+x~=.txt", b"hello")
    listed = next(s3.list_objects(s3_bucket.uri()))
    ours = s3.getters(s3_bucket.name, 4)[0].get_object(listed.key, f'"{listed.etag}"')
    theirs = s3.client(4).get_object(Bucket=s3_bucket.name, Key=listed.key,
                                     IfMatch=f'"{listed.etag}"', ChecksumMode="ENABLED")
    assert ours["ETag"] == theirs["ETag"] == f'"{listed.etag}"'
    assert ours["Body"].read() == theirs["Body"].read() == b"hello"


@pytest.mark.parametrize("kind, error, code", [
    ("denied", "EndpointAuthError", 77),
    ("precondition", "ChangedDatasetError", 2),
])
def test_a_refused_get_is_the_named_error_as_before(s3_bucket, tmp_path, capsys, monkeypatch,
                                                    kind, error, code):
    _objects(s3_bucket, 12)
    with FaultProxy(s3_bucket.endpoint, Rule(rate=1.0, methods={"GET"}, kinds=(kind,),
                                             path=r"/d/1/"), seed=1) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        s3.reset_clients()
        rc = main(["convert", s3_bucket.uri("d/"), str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == code and err.startswith(f"error: {error}: ") and err.count("\n") == 1, err
    assert "/d/1/" in err and proxy.faults[kind] >= 1


def test_an_unsigned_client_gets_through_botocore(s3_bucket, monkeypatch):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    client = boto3.session.Session().client("s3", config=Config(signature_version=UNSIGNED))
    getter = s3get.Getter(client, s3_bucket.name, None)
    assert getter.template is None  # no SigV4 to copy: every GET is botocore's own
    calls = []
    monkeypatch.setattr(client, "get_object", lambda **kw: calls.append(kw) or {"ETag": "x"})
    assert getter.get_object("k", '"e"') == {"ETag": "x"}
    assert calls == [{"Bucket": s3_bucket.name, "Key": "k", "IfMatch": '"e"',
                      "ChecksumMode": "ENABLED"}]


def test_a_botocore_without_the_private_pool_gets_through_get_object(s3_bucket):
    """The template sends through the client's own HTTP session, a private attribute of
    botocore's: where a botocore release lacks it, every GET is botocore's get_object, as
    before."""
    from kfvision.pipelines.clients import s3

    class WithoutPool:  # the real client, less its private _endpoint
        def __init__(self, client):
            self._client = client

        def __getattr__(self, name):
            if name == "_endpoint":
                raise AttributeError(name)
            return getattr(self._client, name)

    getter = s3get.Getter(WithoutPool(s3.client()), s3_bucket.name, None)
    assert getter.template is None
    s3_bucket.put("k", b"data")
    etag = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key="k")["ETag"]
    assert getter.get_object("k", etag)["Body"].read() == b"data"


def test_a_redirect_hands_the_bucket_to_botocore(s3_bucket, monkeypatch):
    put = _objects(s3_bucket, 3)
    getter = s3.getters(s3_bucket.name, 2)[0]
    answered = []

    class Moved:
        status_code, headers = 301, {}

        class raw:  # noqa: N801 (a stand-in for urllib3's response)
            @staticmethod
            def read():
                return b"<Error><Code>PermanentRedirect</Code><Message>elsewhere</Message></Error>"

    real = getter._session.send  # botocore's own calls go through the same session

    def send(request):
        if not answered:
            answered.append(request.url)
            return Moved
        return real(request)

    monkeypatch.setattr(getter._session, "send", send)
    for key, data in put.items():
        etag = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key=key)["ETag"]
        assert getter.get_object(key, etag)["Body"].read() == data
    assert len(answered) == 1 and getter._redirected  # then botocore's get_object for all


def test_a_get_signs_with_the_session_token(s3_bucket, monkeypatch):
    """(A fetch's GETs go through obstore, pipelines/clients/s3obstore.py; this GetObject is
    the one botocore's template makes for what obstore does not take.)"""
    put = _objects(s3_bucket, 4)
    monkeypatch.setenv("AWS_SESSION_TOKEN", "a-session-token")
    s3.reset_clients()
    seen = []
    real = s3get.SigV4.sign

    def spy(self, url, headers, credentials, amz_date=None):
        signed = real(self, url, headers, credentials, amz_date)
        seen.append(signed.get("X-Amz-Security-Token"))
        return signed

    monkeypatch.setattr(s3get.SigV4, "sign", spy)
    getter = s3.getters(s3_bucket.name, 2)[0]
    for key, data in put.items():
        etag = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key=key)["ETag"]
        assert getter.get_object(key, etag)["Body"].read() == data
    assert seen == ["a-session-token"] * len(put)
