"""Rotary position embeddings (HF's rotate-half convention), with llama3 scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {kind!r}")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between
    # interpolated smoothly (Llama 3.1's recipe).
    factor, low, high = (
        float(s["factor"]),
        float(s["low_freq_factor"]),
        float(s["high_freq_factor"]),
    )
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, hd]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.max_positions = max_positions

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, hd], k: [T, KVH, hd], positions: [T] -> rotated q, k."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, hd]
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
