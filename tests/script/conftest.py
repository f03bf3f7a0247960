"""Fixtures of the script tests: one requirements cache for the session."""

from pathlib import Path

import pytest

from kfvision.pipelines import contract


@pytest.fixture(scope="session")
def env_cache(tmp_path_factory) -> Path:
    """One requirements cache for the session: the second local run installs nothing."""
    return tmp_path_factory.mktemp("envs")


@pytest.fixture(autouse=True)
def _cache(env_cache, monkeypatch):
    monkeypatch.setenv(contract.ENV_CACHE, str(env_cache))
