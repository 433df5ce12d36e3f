"""Slow, obviously-correct Gated DeltaNet ops: the oracle for every fast path.

Token by token, sequence by sequence, in float32. Pure functions of their inputs (no
config, no environment, no globals) apart from the state pools they update in place, as
the ops do. Unlike the fast paths they read the batch metadata on the host: they are the
oracle, not a step of the engine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.gated_delta_batch import StateBatch

L2NORM_EPS = 1e-6  # Qwen3.5's (and flash-linear-attention's) l2norm epsilon


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x²) + 1e-6) over the last dim, as Qwen3.5 normalizes q and k."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _sequences(batch: StateBatch):
    cu = batch.cu_seqlens.tolist()
    slots = batch.state_slots.tolist()
    initial = batch.has_initial_state.tolist()
    for i in range(batch.num_seqs):
        yield cu[i], cu[i + 1], slots[i], initial[i]


def causal_conv1d_reference(
    x: torch.Tensor,  # [T, D]: the batch's tokens, sequences concatenated
    weight: torch.Tensor,  # [D, K]: one K-tap filter per channel
    bias: torch.Tensor | None,  # [D]
    conv_state: torch.Tensor,  # [num_slots, D, K-1], x.dtype: updated in place
    batch: StateBatch,
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, D], x.dtype
    """Per sequence with tokens x_s = x[lo:hi] and row `slot` of the pool, the window
    w = cat(prefix, x_sᵀ) [D, K-1 + L], prefix = conv_state[slot] (zeros without an
    initial state):

        out[lo + t, c] = act(sum_j weight[c, j] * w[c, t + j] + bias[c])
        conv_state[slot] = w[:, -(K-1):]          (the last K-1 inputs)

    in float32, act = SiLU (or none), out rounded once into x.dtype.
    """
    out = torch.empty_like(x)
    kernel = weight.shape[1]
    w = weight.float()
    for lo, hi, slot, initial in _sequences(batch):
        if initial:
            prefix = conv_state[slot].float()
        else:
            prefix = torch.zeros(x.shape[1], kernel - 1, device=x.device)
        window = torch.cat([prefix, x[lo:hi].float().T], dim=1)  # [D, K-1 + L]
        for t in range(hi - lo):
            y = (w * window[:, t : t + kernel]).sum(-1)
            if bias is not None:
                y = y + bias.float()
            out[lo + t] = (F.silu(y) if activation == "silu" else y).to(x.dtype)
        conv_state[slot] = window[:, window.shape[1] - (kernel - 1) :].to(conv_state.dtype)
    return out


def gated_delta_rule_reference(
    q: torch.Tensor,  # [T, HK, dk]
    k: torch.Tensor,  # [T, HK, dk]
    v: torch.Tensor,  # [T, HV, dv], HV a multiple of HK
    g: torch.Tensor,  # [T, HV]: log decay, <= 0
    beta: torch.Tensor,  # [T, HV]: write strength in [0, 1]
    recurrent_state: torch.Tensor,  # [num_slots, HV, dk, dv] float32: updated in place
    batch: StateBatch,
) -> torch.Tensor:  # [T, HV, dv], v.dtype
    """Per sequence, per value head h with key head h // (HV // HK), starting from
    S = recurrent_state[slot, h] (zeros without an initial state), for each token t:

        q̂ = l2norm(q[t]) * dk**-0.5,   k̂ = l2norm(k[t])
        S = exp(g[t, h]) * S
        S = S + k̂ ⊗ (beta[t, h] * (v[t, h] - Sᵀ k̂))      (the delta rule)
        out[t, h] = Sᵀ q̂

    then recurrent_state[slot, h] = S. Float32 throughout, out rounded once.
    """
    group = v.shape[1] // k.shape[1]
    scale = k.shape[2] ** -0.5
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    qn = (l2norm(q.float()) * scale).repeat_interleave(group, 1)  # [T, HV, dk]
    kn = l2norm(k.float()).repeat_interleave(group, 1)
    for lo, hi, slot, initial in _sequences(batch):
        state = recurrent_state[slot].clone() if initial else torch.zeros_like(recurrent_state[0])
        for t in range(lo, hi):
            state = state * g[t].float().exp()[:, None, None]  # [HV, dk, dv]
            predicted = torch.einsum("hkv,hk->hv", state, kn[t])
            delta = beta[t].float()[:, None] * (v[t].float() - predicted)  # [HV, dv]
            state = state + kn[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, qn[t]).to(v.dtype)
        recurrent_state[slot] = state
    return out
