"""`from azureml.core import Run` in a kfvision job: Azure ML v1's Run on kfvision's machinery
(kfvision.pipelines.script.azurerun). Put here only when the script's environment has no
azureml-core of its own."""

from kfvision.pipelines.script.azurerun import Experiment, Model, Run, Workspace  # noqa: F401
