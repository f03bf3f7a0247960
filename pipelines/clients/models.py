"""Where a trained model is: `resolve_model(uri)` turns what `--model` accepts into a local path.

    models/r18-trained               a local folder (or ONNX file): as it is
    s3://bucket/models/r18/          fetched once into a cache keyed by its ETags (s3sync)
    models:/digits/3, models:/digits@champion
                                     a registered MLflow model version, fetched once into the
                                     registry's cache (pipelines.clients.registry)

One function, so that every command that takes a model (score, export, serve) and every scheme a
model can come from meet in one place.
"""

from pathlib import Path

from pipelines.clients import s3, s3sync


def resolve_model(uri, *, max_connections: int = s3.DEFAULT_CONNECTIONS) -> Path:
    """The local path of the model at `uri` (a path, an `s3://` prefix or object, or a
    `models:/` URI)."""
    uri = str(uri)
    if uri.startswith("models:/"):  # only then is the registry client imported
        from pipelines.clients import registry

        return registry.resolve_model(uri)
    if s3.is_s3(uri):
        import sys

        print(f"model {uri}: its local copy in {s3sync.cache_root()} (fetched once)",
              file=sys.stderr, flush=True)
        return s3sync.fetch_model(uri, max_connections=max_connections)
    return Path(uri)
