"""`from azureml.core.model import Model` (what register_model returns)."""

from kfvision.pipelines.script.azurerun import Model  # noqa: F401
