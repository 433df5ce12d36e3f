"""Tensor parallelism inside one replica: N ranks on N devices serve one model together.

shard.py     which part of every weight and adapter a rank holds (Megatron, S-LoRA)
comm.py      the collectives (NCCL on CUDA, gloo on CPU), with byte counters
layers.py    what the model calls: row-parallel LoRA linear, vocab-parallel embed/head
adapters.py  per-rank adapter shards, loaded into the slots rank 0 chooses
worker.py    ranks 1..N-1: Ray actors running the steps rank 0 broadcasts
group.py     rank 0: starts the ranks, drives steps and loads, detects a dead rank
"""
