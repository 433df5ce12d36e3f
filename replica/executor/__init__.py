"""How a step reaches the devices: the `Executor` interface (base.py) and its two
implementations, chosen once by create.py.

runner.py     ModelRunner: one rank's weights, adapter slots and KV cache, and its forward
batch.py      BatchPlan -> device tensors (ForwardBatch), one non_blocking copy
memory_plan.py    the GPU memory plan: weights, activations, graphs, adapters, KV cache
              (a pure function; `lorafleet plan` runs it without a GPU)
memory_profile.py one rank's KV cache at start: the plan after profiling the largest step
static_decode.py  decode-only steps at batch-size bucket shapes over persistent inputs,
              replayed as CUDA graphs on CUDA
tp_group.py   rank 0 of a tensor-parallel replica: starts ranks 1..N-1, drives their steps
              and adapter loads, detects a dead rank; TPExecutor
tp_worker.py  ranks 1..N-1: Ray actors running the steps rank 0 broadcasts

May import: adapters (sharded staging, adapter memory), model, and the shared modules.
"""
