"""Fixtures of the cluster tests."""

from __future__ import annotations

import pytest

from cluster import serving


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fails a test that would start (or join) a Ray cluster."""

    def connect(*args, **kwargs):
        raise AssertionError("lorafleet up went on to start Ray")

    monkeypatch.setattr(serving, "connect", connect)
