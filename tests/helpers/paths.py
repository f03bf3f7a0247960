"""Where the repository and the upstream reference files are, and those files read."""

import copy
import functools
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SHARED_REFERENCE = REPO.parent / "shared" / "reference"


def reference_file(*parts) -> Path:
    """A file of ../shared/reference (upstream CRDs, too large to keep in this repository). Skips
    the calling test, saying why, when that folder is not beside the repository (a clone on its
    own); CI has it, so the checks run there."""
    path = SHARED_REFERENCE.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"{path} is absent: the upstream reference files live in ../shared/reference "
                    "beside the repository (CI has them); a clone on its own skips this check")
    return path


@functools.cache
def _parsed(path: Path):
    # libyaml's loader where PyYAML has it: the CRDs are up to 0.9 MB, 1 s each to the pure-Python
    # loader, and many tests read the same ones
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def reference_yaml(*parts):
    """The YAML document of a file of ../shared/reference (skips as reference_file does), parsed
    once a process: a copy of it each call."""
    return copy.deepcopy(_parsed(reference_file(*parts)))
