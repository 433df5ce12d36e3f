"""The replica as Ray Serve runs it: `LoRAReplica` (deployment.py) turns wire requests
into engine calls and engine output into wire replies, `AsyncLLMEngine` (async_engine.py)
runs the engine's step loop on its own thread behind an asyncio face, and metrics.py
exports the engine's telemetry as Prometheus metrics through Ray.

May import: engine, adapters (the object-store source), and the shared modules.
Nothing here speaks HTTP.
"""
