"""Torch path of the Gated DeltaNet ops: the CPU backend (and CUDA when forced).

A batch mixes decodes (one token) and prefill chunks. The decodes run together, one
vectorized recurrent step over all of them (their pool rows gathered once, written back
once); each longer sequence runs the chunked form of the delta rule (WY/UT transform,
Yang et al. 2024, as in flash-linear-attention and transformers' torch fallback), one
sequence at a time. Every op's shape follows the host seq_lens, never a device value,
so a decode batch runs one fixed sequence of ops (graph-safe), and nothing is read back.

The chunked form, per chunk of C = 64 tokens with in-chunk cumulative log decay γ,
decay matrix D[i, j] = exp(γ_i - γ_j) (j <= i) and state S entering the chunk:

    T = (I + strict_lower(diag(β) (k kᵀ ⊙ D)))⁻¹       the UT transform
    u = T diag(β) v,   w = T diag(β exp γ) k             (the WY representation)
    v' = u - w S                                          what S does not yet predict
    o = (q exp γ) S + ((q kᵀ) ⊙ D) v'
    S = exp(γ_C) S + (k exp(γ_C - γ))ᵀ v'

Beyond transformers' version: q kᵀ and k kᵀ at the key heads (not repeated to the value
heads first), T from one triangular solve against I and then matmuls (the batched
solver is slow against the wide [C, dv + dk] right-hand sides), chunks taken
_GROUP_CHUNKS at a time so that the intra-chunk tensors stay in cache, and the scan over
chunks doing only what is sequential (w S and the state update: the outputs then come
from the saved per-chunk states in one batched matmul).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.gated_delta_batch import StateBatch

CHUNK = 64  # tokens per chunk of the chunked form
_GROUP_CHUNKS = 4  # chunks whose intra-chunk work runs as one batch
_CONV_ROWS = 64  # tokens per block of the convolution: a block's taps stay in cache
_EPS = 1e-6  # the l2norm epsilon (kernels.gated_delta_reference.L2NORM_EPS)


def _plan(batch: StateBatch) -> tuple[list[int], list[int], list[int]]:
    """(token offsets [N+1], one-token sequences, longer ones), from host ints."""
    cu = [0]
    for n in batch.seq_lens:
        cu.append(cu[-1] + n)
    decodes = [i for i, n in enumerate(batch.seq_lens) if n == 1]
    return cu, decodes, [i for i, n in enumerate(batch.seq_lens) if n > 1]


def _decode_rows(batch: StateBatch, cu: list[int], decodes: list[int], device: torch.device):
    """(token rows, pool slots, initial-state flags) of the one-token sequences: the
    batch's own tensors when every sequence is one (rows None: all of them, no copy)."""
    if len(decodes) == batch.num_seqs:
        return None, batch.state_slots, batch.has_initial_state
    index = torch.tensor(decodes, device=device)
    rows = torch.tensor([cu[i] for i in decodes], device=device)
    return rows, batch.state_slots[index], batch.has_initial_state[index]


def _initial(pool: torch.Tensor, slots: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """pool[slots] where flags, zeros elsewhere (whatever the row holds, NaN included)."""
    rows = pool.index_select(0, slots.long())
    return rows.masked_fill_(~flags.view(-1, *([1] * (rows.dim() - 1))), 0)


def causal_conv1d(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,  # [D]
    conv_state: torch.Tensor,  # [num_slots, D, K-1], x.dtype
    batch: StateBatch,
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, D], x.dtype
    """See kernels.causal_conv1d (arguments are checked there) and
    kernels.gated_delta_reference.causal_conv1d_reference."""
    out = torch.empty_like(x)
    taps = weight.float().t().contiguous()  # [K, D]
    bias32 = None if bias is None else bias.float()
    cu, decodes, prefills = _plan(batch)
    if decodes:
        rows, slots, flags = _decode_rows(batch, cu, decodes, x.device)
        xd = x if rows is None else x.index_select(0, rows)
        yd = _conv_decode(xd, taps, bias32, conv_state, slots.long(), flags, activation)
        if rows is None:
            out.copy_(yd)
        else:
            out.index_copy_(0, rows, yd)
    for i in prefills:
        lo, hi = cu[i], cu[i + 1]
        slot = batch.state_slots[i : i + 1].long()
        prefix = _initial(conv_state, slot, batch.has_initial_state[i : i + 1])[0]  # [D, K-1]
        _conv_sequence(x[lo:hi], out[lo:hi], taps, bias32, prefix.t().float(), activation)
        kept = torch.cat([prefix.t(), x[lo:hi][-prefix.shape[1] :]])[-prefix.shape[1] :]
        conv_state.index_copy_(0, slot, kept.t()[None].to(conv_state.dtype))
    return out


def _conv_decode(
    x: torch.Tensor,  # [N, D]: each sequence's one token
    taps: torch.Tensor,  # [K, D] float32
    bias: torch.Tensor | None,  # [D] float32
    conv_state: torch.Tensor,  # [num_slots, D, K-1]
    slots: torch.Tensor,  # [N] int64
    flags: torch.Tensor,  # [N] bool
    activation: str | None,
) -> torch.Tensor:  # [N, D], x.dtype
    window = torch.cat([_initial(conv_state, slots, flags), x[:, :, None]], 2)  # [N, D, K]
    y = torch.einsum("ndk,kd->nd", window.float(), taps)
    if bias is not None:
        y += bias
    conv_state.index_copy_(0, slots, window[:, :, 1:].to(conv_state.dtype))
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)


def _conv_sequence(
    x: torch.Tensor,  # [L, D]: one sequence's tokens
    out: torch.Tensor,  # [L, D]: written
    taps: torch.Tensor,  # [K, D] float32
    bias: torch.Tensor | None,  # [D] float32
    prefix: torch.Tensor,  # [K-1, D] float32: the inputs before x (the conv state)
    activation: str | None,
) -> None:
    """out[t] = act(sum_j taps[j] * cat(prefix, x)[t + j] + bias), a block of tokens at
    a time; each block reads its K-1 inputs before it from x (or the prefix)."""
    kernel, length = taps.shape[0], x.shape[0]
    direct = out.dtype == torch.float32  # accumulate in out itself
    for lo in range(0, length, _CONV_ROWS):
        hi = min(lo + _CONV_ROWS, length)
        if lo == 0:
            window = torch.cat([prefix, x[:hi].float()])  # [K-1 + hi, D]
        else:
            window = x[lo - kernel + 1 : hi].float()
        n = hi - lo
        acc = out[lo:hi] if direct else torch.empty_like(window[:n])
        torch.mul(window[:n], taps[0], out=acc)
        for j in range(1, kernel):
            acc.addcmul_(window[j : j + n], taps[j])
        if bias is not None:
            acc += bias
        if activation == "silu":
            F.silu(acc, inplace=True)
        if not direct:
            out[lo:hi] = acc


def gated_delta_rule(
    q: torch.Tensor,  # [T, HK, dk]
    k: torch.Tensor,  # [T, HK, dk]
    v: torch.Tensor,  # [T, HV, dv]
    g: torch.Tensor,  # [T, HV]
    beta: torch.Tensor,  # [T, HV]
    recurrent_state: torch.Tensor,  # [num_slots, HV, dk, dv] float32
    batch: StateBatch,
    out: torch.Tensor | None = None,  # [T, HV, dv], v.dtype
) -> torch.Tensor:  # [T, HV, dv], v.dtype
    """See kernels.gated_delta_rule (arguments are checked there) and
    kernels.gated_delta_reference.gated_delta_rule_reference."""
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    cu, decodes, prefills = _plan(batch)
    if decodes:
        rows, slots, flags = _decode_rows(batch, cu, decodes, v.device)
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        od = _recurrent_step(
            pick(q), pick(k), pick(v), pick(g), pick(beta), recurrent_state, slots.long(), flags
        )
        if rows is None:
            out.copy_(od)
        else:
            out.index_copy_(0, rows, od)
    for i in prefills:
        lo, hi = cu[i], cu[i + 1]
        slot = batch.state_slots[i : i + 1].long()
        state = _initial(recurrent_state, slot, batch.has_initial_state[i : i + 1])[0]
        state = _chunked(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state, out[lo:hi])
        recurrent_state.index_copy_(0, slot, state[None])
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:  # [..., d] -> float32
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _EPS)


def _recurrent_step(
    q: torch.Tensor,  # [N, HK, dk]: each sequence's one token
    k: torch.Tensor,  # [N, HK, dk]
    v: torch.Tensor,  # [N, HV, dv]
    g: torch.Tensor,  # [N, HV]
    beta: torch.Tensor,  # [N, HV]
    pool: torch.Tensor,  # [num_slots, HV, dk, dv] float32
    slots: torch.Tensor,  # [N] int64
    flags: torch.Tensor,  # [N] bool
) -> torch.Tensor:  # [N, HV, dv], v.dtype
    """One token of the recurrence per sequence, S₀ read once: with e = exp(g),
    Sᵀk and Sᵀq from one matmul, δ = β (v - e Sᵀk), out = e Sᵀq + δ (k·q), and the new
    state e S₀ + k ⊗ δ written back."""
    n, hv, dv = v.shape
    dk = k.shape[2]
    group = hv // k.shape[1]
    qn = (_l2norm(q) * dk**-0.5).repeat_interleave(group, 1)  # [N, HV, dk]
    kn = _l2norm(k).repeat_interleave(group, 1)
    decay = g.float().exp()[:, :, None]  # [N, HV, 1]
    s0 = _initial(pool, slots, flags)  # [N, HV, dk, dv]
    read = torch.stack([kn, qn], 2) @ s0  # [N, HV, 2, dv]: Sᵀk, Sᵀq
    delta = beta.float()[:, :, None] * (v.float() - decay * read[:, :, 0])  # [N, HV, dv]
    out = decay * read[:, :, 1] + delta * (kn * qn).sum(-1, keepdim=True)
    s0.mul_(decay[..., None]).view(n * hv, dk, dv).baddbmm_(
        kn.reshape(n * hv, dk, 1), delta.reshape(n * hv, 1, dv)
    )
    pool.index_copy_(0, slots, s0)
    return out.to(v.dtype)


def _chunk_major(x: torch.Tensor, chunks: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[L, H, ...] (times `scale` [L, H, 1] when given) -> [chunks, H, CHUNK, ...] float32,
    zero past L: one pass over x."""
    length, heads, rest = x.shape[0], x.shape[1], x.shape[2:]
    dst = torch.empty((chunks, heads, CHUNK, *rest), dtype=torch.float32, device=x.device)
    token_major = dst.transpose(1, 2)  # [chunks, CHUNK, H, ...], a view

    def fill(into: torch.Tensor, lo: int, hi: int) -> None:
        src = x[lo:hi].view(into.shape)
        if scale is None:
            into.copy_(src)
        else:
            torch.mul(src, scale[lo:hi].view(*into.shape[:-1], 1), out=into)

    full = length // CHUNK
    fill(token_major[:full], 0, full * CHUNK)
    if full < chunks:
        tail = length - full * CHUNK
        fill(token_major[full, :tail], full * CHUNK, length)
        token_major[full, tail:] = 0
    return dst


def _inverse_norm(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """[L, H, d] -> [L, H, 1] float32: scale / sqrt(sum(x²) + eps), one pass over x."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return (norm.square_() + _EPS).rsqrt_().mul_(scale)


def _chunked(
    q: torch.Tensor,  # [L, HK, dk]: one sequence
    k: torch.Tensor,  # [L, HK, dk]
    v: torch.Tensor,  # [L, HV, dv]
    g: torch.Tensor,  # [L, HV]
    beta: torch.Tensor,  # [L, HV]
    state: torch.Tensor,  # [HV, dk, dv] float32: the state before the sequence
    out: torch.Tensor,  # [L, HV, dv]: written
) -> torch.Tensor:  # [HV, dk, dv] float32: the state after it
    length, hk, dk = k.shape
    hv, dv = v.shape[1:]
    group = hv // hk
    chunks = -(-length // CHUNK)
    # [n, H, C, d] float32, zero-padded: padded tokens have k = v = β = g = 0, so they
    # neither write the state nor decay it
    qc = _chunk_major(q, chunks, _inverse_norm(q, dk**-0.5))
    kc = _chunk_major(k, chunks, _inverse_norm(k))
    vc = _chunk_major(v, chunks)
    gc = _chunk_major(g[:, :, None], chunks)[..., 0]  # [n, HV, C]
    bc = _chunk_major(beta[:, :, None], chunks)[..., 0]
    above = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=v.device).triu(1)
    eye = torch.eye(CHUNK, device=v.device)
    for c0 in range(0, chunks, _GROUP_CHUNKS):
        c1 = min(c0 + _GROUP_CHUNKS, chunks)
        m = c1 - c0
        qs, ks, vs, bs = qc[c0:c1], kc[c0:c1], vc[c0:c1], bc[c0:c1]
        gamma = gc[c0:c1].cumsum(-1)  # [m, HV, C]
        decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill_(above, -torch.inf)
        decay = decay.exp_().view(m, hk, group, CHUNK, CHUNK)  # D, zero above the diagonal
        kkt = (ks @ ks.mT)[:, :, None]  # [m, HK, 1, C, C]: shared by the head's value heads
        system = torch.mul(kkt, decay).mul_(bs.view(m, hk, group, CHUNK, 1))  # diagonal unread
        t = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
        # T diag(β), written row-major (the solver's T is column-major): the value heads of
        # a key head then make one [G*C, C] matrix, T diag(β exp γ), against its k
        tb = torch.empty(m, hv, CHUNK, CHUNK, device=v.device)
        torch.mul(t.view(m, hv, CHUNK, CHUNK), bs[..., None, :], out=tb)
        u = tb @ vs  # [m, HV, C, dv]
        gexp = gamma.exp()
        tbg = (tb * gexp[..., None, :]).view(m, hk, group * CHUNK, CHUNK)
        w = (tbg @ ks).view(m, hv, CHUNK, dk)
        attn = ((qs @ ks.mT)[:, :, None] * decay).view(m, hv, CHUNK, CHUNK)
        q_decayed = (qs[:, :, None] * gexp.view(m, hk, group, CHUNK, 1)).view(m, hv, CHUNK, dk)
        to_end = (gamma[..., -1:] - gamma).exp().view(m, hk, group, CHUNK, 1)
        k_decayed = (ks[:, :, None] * to_end).view(m, hv, CHUNK, dk)
        chunk_decay = gamma[..., -1].exp()[..., None, None]  # [m, HV, 1, 1]

        states = torch.empty(m + 1, hv, dk, dv, device=v.device)  # entering each chunk
        states[0] = state
        v_new = u  # becomes v' = u - w S in place, chunk by chunk
        for i in range(m):
            v_new[i].baddbmm_(w[i], states[i], alpha=-1)
            torch.mul(states[i], chunk_decay[i], out=states[i + 1])
            states[i + 1].baddbmm_(k_decayed[i].mT, v_new[i])
        state = states[m]

        o = (attn @ v_new).view(m * hv, CHUNK, dv)
        o.baddbmm_(q_decayed.view(m * hv, CHUNK, dk), states[:m].view(m * hv, dk, dv))
        rows = min(c1 * CHUNK, length) - c0 * CHUNK
        _token_major(o.view(m, hv, CHUNK, dv), out[c0 * CHUNK : c0 * CHUNK + rows])
    return state


def _token_major(x: torch.Tensor, out: torch.Tensor) -> None:
    """out[c*CHUNK + t, h] = x[c, h, t] for the rows out has: [m, H, CHUNK, d] chunk-major
    back to the tokens' [rows, H, d], in one pass."""
    m, heads, _, d = x.shape
    full = out.shape[0] // CHUNK
    x = x.transpose(1, 2)  # [m, CHUNK, H, d], a view
    out[: full * CHUNK].view(full, CHUNK, heads, d).copy_(x[:full])
    if full < m:
        out[full * CHUNK :].copy_(x[full, : out.shape[0] - full * CHUNK])
