"""Serving a trained model: the KServe model (model.py), request batching (batcher.py), the model
server (server.py), a stdlib client (client.py) and the KServe InferenceService (deploy.py).
Nothing here imports kserve at package import: `kfvision --help` stays light."""
