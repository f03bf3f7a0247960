"""Golden files (tests/golden/): compared with what is rendered now, rewritten when
KFVISION_UPDATE_GOLDEN=1 (the Makefile's golden-* targets)."""

import difflib
import os
from pathlib import Path

import pytest

from helpers.paths import REPO

GOLDEN_DIR = REPO / "tests" / "golden"
UPDATE = os.environ.get("KFVISION_UPDATE_GOLDEN") == "1"


def assert_same_text(expected_path: Path, actual: str, fix: str) -> None:
    expected = expected_path.read_text() if expected_path.exists() else ""
    if expected != actual:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                            str(expected_path), "rendered now"))
        pytest.fail(f"{expected_path.name} is not what render writes now; if that is "
                    f"intended run `{fix}` and review the diff:\n{diff}")
