"""How a step reaches the devices: the `Executor` interface (base.py) and its two
implementations, chosen once by create.py.

runner.py     ModelRunner: one rank's weights, adapter slots and KV cache, and its forward
batch.py      BatchPlan -> device tensors (ForwardBatch), one non_blocking copy
static_decode.py  decode-only steps at batch-size bucket shapes over persistent inputs,
              replayed as CUDA graphs on CUDA
tp_group.py   rank 0 of a tensor-parallel replica: starts ranks 1..N-1, drives their steps
              and adapter loads, detects a dead rank; TPExecutor
tp_worker.py  ranks 1..N-1: Ray actors running the steps rank 0 broadcasts

May import: adapters (sharded staging), model, and the shared modules.
"""
