"""The step loop of one replica: schedule -> plan -> forward -> sample -> emit.

engine.py           LLMEngine: requests in, StepOutputs out, one step at a time
scheduler.py        continuous batching under token, KV, adapter-count and readiness budgets
sequence.py         a request as the engine tracks it
planner.py          scheduled sequences -> a BatchPlan of host ints (no tensors)
block_allocator.py  which KV blocks are free (host-only)
telemetry.py        counters, the residency snapshot for routing, metrics telemetry

May import: executor, adapters, model (the sampler), and the shared modules. The
scheduler and planner never touch a tensor.
"""
