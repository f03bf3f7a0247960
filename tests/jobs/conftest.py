"""Fixtures of the job tests."""

import pytest
from helpers.replicas import FLAKY


@pytest.fixture
def flaky_replicas(tmp_path):
    """flaky_replicas(codes) -> the script of a 2-node job's replicas (PyTorchJob or TrainJob):
    node 1 fails with `codes`, one per start, then succeeds; node 0 waits for it."""
    return lambda codes: FLAKY.format(tmp=tmp_path, codes=codes)
