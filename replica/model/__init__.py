"""Tensors: one decoder for every served family and what it runs on.

decoder.py          the model and its forward over a flattened mixed batch; paged
                    attention over the KV cache (prefill and decode)
families.py         config.json -> what a family changes on ModelSpec (norms, caps, windows...)
gemma4_config.py    Gemma 4's config -> its per-layer shapes, shared KV, ropes, MoE block
hybrid.py           LinearAttentionSpec: a hybrid model's linear-attention shapes and state
gated_deltanet.py   Qwen3.5's Gated DeltaNet layer and the per-sequence state pool
per_layer_inputs.py Gemma 4's per-layer input embeddings and each layer's block
gemma4_moe.py       Gemma 4's experts beside the dense MLP
moe.py              a sparse MLP: router, experts grouped by expert, expert LoRA
layout.py           where a checkpoint keeps each tensor (prefixes, fused rows, a rank's part;
                    gpt-oss's MXFP4 experts, kept packed)
rope.py             rotary embeddings (linear, llama3, yarn, longrope; partial rotary)
spec.py             ModelSpec: the shapes and the family's differences
hf_config.py        config.json values several modules read (rope parameters, layer types)
weights.py          safetensors checkpoints (what was read), or seeded dummy weights
quant_config.py     quantization_config -> each projection's packed format, or a refusal
quant_weights.py    packed projections read as stored, cut for a rank, multiplied packed
kv_cache.py         the paged KV cache's tensors
lora.py             LoRA-aware projections (base GEMM, shrink, expand) and their buffers
lora_slots.py       the slot-stacked A/B buffers of every layer, and copies into them
adapter_weights.py  a PEFT adapter's tensors converted to the engine layout
peft_config.py      adapter_config.json: what is refused, PEFT's pattern and layer rules
sampler.py          greedy / temperature / top-k / top-p sampling, one device read
tp_shard.py         what a tensor-parallel rank holds of every weight and adapter
tp_comm.py          the collectives (NCCL on CUDA, gloo on CPU)
tp_layers.py        row-parallel LoRA linear, vocab-parallel embedding and head

May import: kernels and the shared modules; nothing of the layers above.
"""
