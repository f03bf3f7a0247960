"""Where the import names come from (pyproject.toml holds everything else).

The repository keeps its two folders `trainer/` and `pipelines/`; the wheel installs them as
`kfvision.trainer` and `kfvision.pipelines` under one import name of the project's own, so that
neither meets a user's `trainer.py`, Vertex AI's `trainer/` package or another distribution's
top-level `trainer` (README.md, "Where things are"). The package list is derived from the folders,
so a new sub-package needs no edit here; namespace packages count (trainer/data, model and use have
no __init__.py), as pyproject's `packages.find` counted them before.
"""

from setuptools import find_namespace_packages, setup

FOLDERS = ("trainer", "pipelines")

packages = find_namespace_packages(include=[f"{f}*" for f in FOLDERS], exclude=["*__pycache__"])
setup(
    packages=[f"kfvision.{p}" for p in packages],
    package_dir={f"kfvision.{f}": f for f in FOLDERS},
)
