"""Fixtures of the replica tests."""

from __future__ import annotations

import pytest

from tests.replica.fake_cuda import FakeCUDA, install


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCUDA:
    """torch.cuda replaced by a recording FakeCUDA of two devices."""
    return install(monkeypatch)
