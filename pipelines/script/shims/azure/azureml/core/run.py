"""`from azureml.core.run import Run` (kfvision.pipelines.script.azurerun)."""

from kfvision.pipelines.script.azurerun import Run  # noqa: F401
