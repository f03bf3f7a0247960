"""The wheel the image installs (`pip install .`) holds every module of the repository's two
folders under its one import name, kfvision (setup.py), and nothing else of ours."""

import subprocess
import zipfile

from helpers.paths import REPO

FOLDERS = ("trainer", "pipelines")


def test_the_wheel_holds_every_module_under_kfvision(kfvision_wheel):
    listed = subprocess.run(["git", "ls-files", *FOLDERS], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.split()
    ours = {f"kfvision/{f}" for f in listed if f.endswith(".py")}
    with zipfile.ZipFile(kfvision_wheel) as wheel:
        shipped = {n for n in wheel.namelist() if not n.startswith("kfvision-")}
    assert ours and shipped == ours, (sorted(ours - shipped)[:5], sorted(shipped - ours)[:5])
