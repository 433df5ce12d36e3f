"""LoRAReplica objects the serve tests build by hand around an engine, and a request that
runs until something stops it."""

from __future__ import annotations

from typing import Any

from replica.engine.engine import LLMEngine
from replica.serve.async_engine import AsyncLLMEngine
from replica.serve.deployment import LoRAReplica
from replica.wire import SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)


def replica(engine: LLMEngine | None = None) -> Any:
    """Return a LoRAReplica made without its constructor (no Serve, no store), serving
    `engine` when given."""
    r = LoRAReplica.__new__(LoRAReplica)
    if engine is not None:
        r.engine, r.aengine, r.source = engine, AsyncLLMEngine(engine), engine.adapters.source
    return r
