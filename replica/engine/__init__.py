"""The step loop of one replica: schedule -> plan -> forward -> sample -> emit.

engine.py           LLMEngine: GenerateRequests in, a wire.Reply per choice per step out;
                    RequestLimits: what a request may ask (checked once, on arrival)
emit.py             a step's draws and its one device read -> Replies: tokens
                    appended, choices forked, ends
scheduler.py        continuous batching under token, KV, adapter-count and readiness budgets
fair_share.py       admission order: FCFS, or VTC fair share between tenants
sequence.py         a request as the engine tracks it (its GenerateRequest, per choice)
structured.py       structured output: grammar matchers and bitmasks
planner.py          scheduled sequences -> a BatchPlan of host ints (no tensors)
block_allocator.py  KV blocks: reference counts, free list, cached blocks (host-only)
state_slots.py      a hybrid model's state-pool rows: one per running sequence (host-only)
prefix_cache.py     prefix caching: block keys per adapter version, hits, commits
telemetry.py        counters, the residency snapshot for routing, metrics telemetry

May import: executor, adapters, model (the sampler), and the shared modules. The
scheduler and planner never touch a tensor.
"""
