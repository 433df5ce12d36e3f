"""The paged KV cache's tensors: fixed-size blocks of one preallocated pool per layer.

Which block holds which sequence's tokens is the engine's host-only bookkeeping
(engine/kv_blocks.py), so admission never touches the device.
"""

from __future__ import annotations

import torch

from replica.device import to_device
from replica.model.gated_deltanet import StatePool
from replica.model.spec import ModelSpec


class KVCache:
    """k[layer], v[layer]: [num_kv_heads, num_blocks * block_size, head_dim].

    One pool per layer that owns its KV (spec.kv_layers); a layer that shares another's
    KV holds that layer's tensors, and a layer without KV holds None. Head-major, so
    gathering a sequence's tokens yields the [heads, L, head_dim] planes attention consumes
    without a transpose copy (faster for CPU decode than block-major:
    docs/performance.md). Token slot = block * block_size + offset."""

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        num_kv_heads: int | None = None,
        num_state_slots: int = 0,
    ) -> None:
        """`num_state_slots`: rows of a hybrid model's linear-attention state pool
        (`states`, model/gated_deltanet.py): one per sequence that may run at once, plus
        a scratch row; None without linear-attention layers."""

        def pool(layer: int) -> torch.Tensor:  # a layer's own head_dim and KV heads
            s = spec.layer(layer)
            kvh = num_kv_heads or s.num_kv_heads
            shape = (kvh, num_blocks * block_size, s.head_dim)
            return torch.zeros(shape, device=device, dtype=dtype)

        owned = {i: (pool(i), pool(i)) for i in spec.kv_layers}
        sources = [spec.kv_source(i) for i in range(spec.num_layers)]
        self.k = [None if s is None else owned[s][0] for s in sources]
        self.v = [None if s is None else owned[s][1] for s in sources]
        self.pools = [t for kv in owned.values() for t in kv]  # each owned tensor once
        self.num_blocks, self.block_size = num_blocks, block_size
        self.states: StatePool | None = None
        if spec.linear_attention is not None:
            self.states = StatePool(
                spec.linear_attention, spec.num_layers, num_state_slots, device, dtype
            )

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Block src[i]'s tokens into block dst[i], in every layer's K and V: on the device,
        in stream order (after the step that wrote src), without a host read."""
        if not src:
            return
        bs, device = self.block_size, self.pools[0].device
        offsets = torch.arange(bs, dtype=torch.int64)

        def slots(blocks: list[int]) -> torch.Tensor:
            host = (torch.tensor(blocks, dtype=torch.int64)[:, None] * bs + offsets).view(-1)
            return to_device(host, device)

        src_slots, dst_slots = slots(src), slots(dst)
        for cache in self.pools:
            cache.index_copy_(1, dst_slots, cache.index_select(1, src_slots))

    @staticmethod
    def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        per_token = sum(spec.layer(i).kv_size for i in spec.kv_layers)
        return 2 * block_size * per_token * elem
