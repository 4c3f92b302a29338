"""Fixtures for the backend conformance suite (helpers live in transfer_harness.py). A skip
here fails under CI=true (tests/conftest.py): case_params() leaves unavailable backends
unskipped in CI, so a missing backend fails loudly."""

from __future__ import annotations

import pytest
from transfer_harness import Pair, Proc, case_params


@pytest.fixture(scope="module", params=case_params())
def pair(request):
    p = Pair(*request.param)
    yield p
    p.stop()


@pytest.fixture
def procs():
    """Extra processes a test starts; all stopped at the end, whatever happens."""
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()
