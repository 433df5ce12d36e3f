"""Converted adapters <-> plain numpy payloads, the form they take in Ray's object store.

Numpy arrays travel through the object store out of band: `ray.get` on the same
node maps them read-only from shared memory instead of copying, which is why the
payload is numpy and not torch (torch tensors are pickled by value). bfloat16 has
no numpy dtype, so its bits travel as int16 and the dtype name rides along.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from replica.model.adapter_weights import LoRAAdapterWeights, SelectLoRA

_BITS = {torch.bfloat16: np.int16}


def pack_adapter(adapter: LoRAAdapterWeights) -> dict[str, Any]:
    """A dict of plain values and numpy arrays: what the AdapterStore ray.put()s."""
    weights = {}
    for (layer, module), (a, b) in adapter.weights.items():
        weights[f"{layer}.{module}"] = (_to_numpy(a), _to_numpy(b))
    dtype = next(iter(adapter.weights.values()))[0].dtype if adapter.weights else torch.float32
    return {
        "name": adapter.name,
        "rank": adapter.rank,
        "scaling": adapter.scaling,
        "target_modules": list(adapter.target_modules),
        "dtype": str(dtype).removeprefix("torch."),
        "weights": weights,
        "layer_paths": {f"{layer}.{m}": p for (layer, m), p in adapter.layer_paths.items()},
    }


def unpack_adapter(
    payload: dict[str, Any], name: str | None = None, select: SelectLoRA | None = None
) -> LoRAAdapterWeights:
    """Host tensors from a payload. Copies: the arrays may be read-only shared memory that
    lives only as long as the ObjectRef does. With `select`, only the part it picks of
    each module's arrays is copied (a tensor-parallel rank's shard)."""
    dtype = getattr(torch, payload["dtype"])
    weights = {}
    for key, (a, b) in payload["weights"].items():
        layer, module = key.split(".", 1)
        if select is not None:
            a, b = select(module, a, b, layer=int(layer))  # numpy views: nothing copied
        weights[(int(layer), module)] = (_to_torch(a, dtype), _to_torch(b, dtype))
    paths = {}
    for key, path in payload["layer_paths"].items():
        layer, module = key.split(".", 1)
        paths[(int(layer), module)] = path
    return LoRAAdapterWeights(
        name or payload["name"],
        int(payload["rank"]),
        float(payload["scaling"]),
        tuple(payload["target_modules"]),
        weights,
        paths,
    )


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    bits = _BITS.get(t.dtype)
    return t.view(torch.int16).numpy() if bits is not None else t.numpy()


def _to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(np.array(a, copy=True, order="C"))  # own, writable, contiguous
    return t.view(dtype) if dtype in _BITS else t
