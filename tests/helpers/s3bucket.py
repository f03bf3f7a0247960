"""A bucket on the test S3 server (the `s3_bucket` fixture), and the retry policy tests use."""

from pathlib import Path


def _fast_retries():
    from kfvision.pipelines.clients.s3 import RetryPolicy

    return RetryPolicy(base_s=0.01, cap_s=0.2, total_s=20.0, connect_timeout_s=5.0,
                       read_timeout_s=10.0)


FAST_RETRIES = _fast_retries()


class S3Bucket:
    """A fresh bucket on the test server, and helpers to fill it."""

    def __init__(self, name: str, endpoint: str):
        from kfvision.pipelines.clients import s3

        self.name, self.endpoint = name, endpoint
        self.client = s3.client()
        self.client.create_bucket(Bucket=name)

    def uri(self, key: str = "") -> str:
        return f"s3://{self.name}/{key}"

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.name, Key=key, Body=data)

    def upload_folder(self, folder: Path, prefix: str) -> int:
        """Every file under `folder` to `prefix` (paths kept); returns how many."""
        files = [p for p in sorted(Path(folder).rglob("*")) if p.is_file()]
        for p in files:
            self.put(prefix + p.relative_to(folder).as_posix(), p.read_bytes())
        return len(files)
