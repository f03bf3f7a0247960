"""Serving a trained model: the KServe model (kservemodel.py), request batching (batcher.py), the
model server (server.py), a stdlib client (client.py), the KServe InferenceService (deploy.py) and
its client on a cluster (deployclient.py), and the deploy step's local check (selfcheck.py).
Nothing here imports kserve at package import: `kfvision --help` stays light."""
