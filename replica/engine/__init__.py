"""The step loop of one replica: schedule -> plan -> forward -> sample -> emit.

engine.py           LLMEngine: GenerateRequests in, a wire.Reply per choice per step out;
                    RequestLimits: what a request may ask (checked once, on arrival)
emit.py             a step's draws and its one device read -> Replies: tokens
                    appended, choices forked, ends
scheduler.py        continuous batching under token, KV, adapter-count and readiness budgets;
                    the admission-policy protocol and FCFS, its default; plan_step:
                    scheduled sequences -> a BatchPlan of host ints (no tensors)
fair_share.py       admission order by VTC fair share between tenants
sequence.py         a request as the engine tracks it (its GenerateRequest, per choice)
structured.py       structured output: grammar matchers and bitmasks
kv_blocks.py        KV blocks: reference counts, free list, cached blocks; the prefix cache
                    over them: block keys per adapter version, hits, commits (host-only)
state_slots.py      a hybrid model's state-pool rows: one per running sequence (host-only)
telemetry.py        counters, the residency snapshot for routing, metrics telemetry

May import: executor, adapters, model (the sampler), and the shared modules. The
scheduler (plan_step included) never touches a tensor.
"""
