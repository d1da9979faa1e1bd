"""Fixtures of the CPU integration tests."""

from __future__ import annotations

import pytest
from helpers import megatron_world  # tests/ is on sys.path (conftest)


@pytest.fixture(scope="module")
def world():
    """One gloo rank with megatron's parallel state (TP=1, EP=1) for the test module."""
    with megatron_world():
        yield
