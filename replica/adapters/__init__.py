"""Where adapter weights are, and how they move: source -> host cache -> device slot.

residency.py     AdapterResidency: the chain wired once, an adapter's lifecycle, and the
                 S-LoRA prefetcher (loads from the waiting queue, overlapped with steps)
sources.py       the source protocols and PEFT directories as a source
object_store.py  the cluster's source: converted weights in Ray's object store
packing.py       converted weights <-> the arrays put in the object store
host_cache.py    adapters staged in pinned host memory, LRU under a byte budget
slot_pool.py     which adapter is in which device slot (slot 0 is the pinned base model),
                 and the LRU/FIFO policies that pick a victim
sharded.py       tensor parallelism: each rank stages its shard into rank 0's chosen slot

May import: model (the slot buffers and the adapter weight layout) and the shared modules.
"""
