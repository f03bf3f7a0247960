"""Where the repository and the upstream reference files are."""

from pathlib import Path

import pytest

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
