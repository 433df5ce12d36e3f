"""The engine LoRAReplica tests drive: the tiny model, adapter-00 registered as version 1."""

from __future__ import annotations

import pytest

from replica.engine.engine import LLMEngine
from replica.wire import AdapterKey
from tests.engines import make_engine


@pytest.fixture
def engine(tiny) -> LLMEngine:
    key = str(AdapterKey("adapter-00", 1))  # the name the replica gives a version
    return make_engine(tiny, {key: tiny.adapters["adapter-00"]})
