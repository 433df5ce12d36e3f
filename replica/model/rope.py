"""Rotary position embeddings (HF's rotate-half convention).

Supported `rope_type`s, computed as transformers' modeling_rope_utils does: default, linear,
llama3, yarn, longrope and proportional (Gemma 4); plus partial rotary (only the first
`rotary_dim` dims of each head are rotated, the rest pass through, as in Phi-3 / Phi-4-mini).

`scaling` is the checkpoint's rope dict (HF `rope_parameters` / `rope_scaling`, without
`rope_theta`), or None for plain RoPE. The type is read from "rope_type" (or the legacy
"type"). Keys each type reads:

  linear    factor
  llama3    factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
  yarn      original_max_position_embeddings, and factor (if absent or None, derived as
            max_position_embeddings / original_max_position_embeddings); optional
            beta_fast (32), beta_slow (1), truncate (True), attention_factor, mscale,
            mscale_all_dim
  proportional  partial_rotary_factor (the share of frequency pairs rotated), factor
  longrope  short_factor, long_factor (rotary_dim / 2 floats each),
            original_max_position_embeddings, and factor or max_position_embeddings
            (factor = max_position_embeddings / original when factor is absent or None;
            only needed when attention_factor is absent); optional attention_factor

Phi-3 style configs keep `original_max_position_embeddings` at the config's top level, and
transformers then gives that value priority over the rope dict's: the caller must copy it
(and `max_position_embeddings`) into `scaling`. `scaling` may also carry
`partial_rotary_factor`, used when RotaryEmbedding gets no explicit `rotary_dim`.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def inverse_frequencies(
    dim: int, theta: float, scaling: dict[str, Any] | None, *, long_context: bool = False
) -> torch.Tensor:
    """inv_freq [dim / 2] for a rotary dimension `dim` (head_dim, or less for partial rotary).

    `long_context` only matters for longrope: long_factor if True, else short_factor
    (transformers' choice for sequences no longer than original_max_position_embeddings).
    """
    kind = rope_type(scaling)
    if kind == "default":
        return _base_inv_freq(dim, theta)
    assert scaling is not None
    if kind == "linear":
        return _base_inv_freq(dim, theta) / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(_base_inv_freq(dim, theta), scaling)
    if kind == "yarn":
        return _yarn(dim, theta, scaling)
    if kind == "proportional":
        return _proportional(dim, theta, scaling)
    if kind == "longrope":
        ext = scaling["long_factor" if long_context else "short_factor"]
        if len(ext) != dim // 2:
            raise ValueError(f"longrope factors need {dim // 2} entries, got {len(ext)}")
        ext_factors = torch.tensor(ext, dtype=torch.float32)
        return 1.0 / (ext_factors * theta ** (torch.arange(0, dim, 2).float() / dim))
    raise ValueError(f"unsupported rope_type {kind!r}")


def _proportional(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Gemma 4's full layers: the first partial_rotary_factor of the dim / 2 frequency
    pairs at theta^(-2j/dim) (over the whole head, not the rotated share), the rest 0 (cos
    1, sin 0: passed through), all divided by factor."""
    angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * dim // 2)
    rotated = 1.0 / theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32) / dim)
    inv_freq = torch.cat([rotated, torch.zeros(dim // 2 - angles)])
    return inv_freq / float(scaling.get("factor", 1.0))


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor transformers multiplies cos and sin by (1.0 except for yarn and longrope)."""
    kind = rope_type(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    assert scaling is not None
    explicit = scaling.get("attention_factor")
    if explicit is not None:
        return float(explicit)
    factor = _scale_factor(scaling)
    if kind == "longrope":
        if factor <= 1.0:
            return 1.0
        old_ctx = scaling["original_max_position_embeddings"]
        return math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def rope_tables(
    rotary_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin tables [max_positions, rotary_dim], attention factor included."""
    t = torch.arange(max_positions, dtype=torch.float32)
    if rope_type(scaling) == "longrope":
        # transformers re-picks short/long factors for the whole sequence from its current
        # length, re-rotating every key; cached keys cannot be re-rotated, so each position
        # keeps one rotation: short_factor below original_max_position_embeddings, long_factor
        # from it on. Positions < original match HF on a short sequence, positions >= original
        # match HF on a long one; a sequence crossing the boundary mixes the two (HF would use
        # long_factor for all of it). vLLM instead uses long_factor everywhere when its
        # max_model_len exceeds the original context.
        assert scaling is not None
        old_ctx = int(scaling["original_max_position_embeddings"])
        short = inverse_frequencies(rotary_dim, theta, scaling, long_context=False)
        long = inverse_frequencies(rotary_dim, theta, scaling, long_context=True)
        freqs = torch.cat([torch.outer(t[:old_ctx], short), torch.outer(t[old_ctx:], long)])
    else:
        freqs = torch.outer(t, inverse_frequencies(rotary_dim, theta, scaling))  # [P, rd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, rd]
    cos, sin = emb.cos(), emb.sin()
    scale = attention_factor(scaling)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _scale_factor(s: dict[str, Any]) -> float:
    # Context extension ratio: explicit `factor`, else max_position_embeddings / original.
    if s.get("factor") is not None:
        return float(s["factor"])
    if s.get("max_position_embeddings") is None:
        raise ValueError(f"{rope_type(s)} rope needs 'factor' or 'max_position_embeddings'")
    return s["max_position_embeddings"] / s["original_max_position_embeddings"]


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    # High frequencies (many rotations within the original context) are kept, low ones
    # divided by `factor`, with a linear ramp over the dims between (YaRN, arXiv 2309.00071).
    factor = _scale_factor(s)
    old_ctx = s["original_max_position_embeddings"]
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_ctx / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp

    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    return inv_freq_interpolation * (1 - extrapolation) + inv_freq_extrapolation * extrapolation


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position.

    `rotary_dim` (even, <= head_dim) is how many leading dims of each head are rotated; by
    default int(head_dim * scaling["partial_rotary_factor"]), or head_dim. The tables sit
    side by side ([max_positions, 2, rotary_dim]) so a step gathers both in one op.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
        dtype: torch.dtype,
        rotary_dim: int | None = None,
    ) -> None:
        if rotary_dim is None:
            partial = (scaling or {}).get("partial_rotary_factor") or 1.0
            rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and in (0, {head_dim}]")
        cos, sin = rope_tables(rotary_dim, max_positions, theta, scaling)
        self.table = torch.stack([cos, sin], dim=1).to(device=device, dtype=dtype)
        self.cos, self.sin = self.table[:, 0], self.table[:, 1]  # [P, rd] views
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.max_positions = max_positions

    def at(self, positions: torch.Tensor) -> Rotation:
        """The rotation of tokens at `positions` [T]: cos and sin gathered once, for every
        layer of the step that shares this table."""
        cos_sin = self.table.index_select(0, positions)  # [T, 2, rd]
        return Rotation(cos_sin[:, 0:1], cos_sin[:, 1:2], self.rotary_dim)

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, hd], k: [T, KVH, hd], positions: [T] -> rotated q, k."""
        rotation = self.at(positions)
        return rotation.rotate(q), rotation.rotate(k)


class Rotation:
    """cos and sin [T, 1, rotary_dim] of one step's positions, applied to any heads."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> None:
        self.cos, self.sin, self.rotary_dim = cos, sin, rotary_dim

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, N, hd] (any strides, e.g. q and k side by side in a fused projection's
        output) -> a rotated copy: x·cos + rotate_half(x)·sin over the first rotary_dim
        dims, the rest passed through.

        As x1·c - x2·s and x2·c + x1·s on the halves, the products rounded before the
        sums as transformers rounds them (bit for bit its result), in four elementwise
        ops instead of rotate_half's negation and concatenation and a product and sum
        more: on a CPU each op is a parallel region the threads meet at."""
        rd, half = self.rotary_dim, self.rotary_dim // 2
        if rd == x.shape[-1]:
            out, part = x * self.cos, x
        else:  # partial rotary
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            part = x[..., :rd]
            torch.mul(part, self.cos, out=out[..., :rd])
            out[..., rd:] = x[..., rd:]
        sin = part * self.sin  # [x1·s, x2·s]
        out[..., :half].sub_(sin[..., half:])
        out[..., half:rd].add_(sin[..., :half])
        return out
