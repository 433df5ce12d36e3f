"""The engine LoRAReplica tests drive: the tiny model, adapter-00 registered as version 1."""

from __future__ import annotations

import pytest

from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.wire import AdapterKey


@pytest.fixture
def engine(tiny) -> LLMEngine:
    config = EngineConfig(model=str(tiny.model_dir), device="cpu", kv_cache_bytes=16 << 20)
    eng = LLMEngine(config)
    key = str(AdapterKey("adapter-00", 1))  # the name the replica gives a version
    eng.load_adapter(key, tiny.adapters["adapter-00"])
    return eng
