"""Tensors: our Llama-family model (Llama, Mistral, Qwen2 layouts) and what it runs on.

llama.py            the model and its forward over a flattened mixed batch
attention.py        paged attention over the KV cache (prefill and decode)
rope.py             rotary embeddings (with llama3 scaling)
spec.py             ModelSpec: the shapes read from config.json
weights.py          safetensors checkpoints
kv_cache.py         the paged KV cache's tensors
lora.py             LoRA-aware projections (base GEMM, shrink, expand) and their buffers
lora_slots.py       the slot-stacked A/B buffers of every layer, and copies into them
adapter_weights.py  a PEFT adapter converted to the engine layout
sampler.py          greedy / temperature / top-k / top-p sampling, one device read
tp_shard.py         what a tensor-parallel rank holds of every weight and adapter
tp_comm.py          the collectives (NCCL on CUDA, gloo on CPU)
tp_layers.py        row-parallel LoRA linear, vocab-parallel embedding and head

May import: kernels and the shared modules; nothing of the layers above.
"""
