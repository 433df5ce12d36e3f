"""Our rotary tables and rotation against transformers' rotary embedding classes, fp32 on CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config, Qwen3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as qwen3_apply

from replica.model.rope import RotaryEmbedding, attention_factor, inverse_frequencies

ATOL = 1e-5
HEAD_DIM = 64
THETA = 1_000_000.0
MAX_POS = 4096
ORIG = 1024  # original (pretraining) context of the scaled variants

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}
QWEN_ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIG},
    "yarn": YARN,
    "yarn-mscale": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn-attention-factor": {**YARN, "attention_factor": 1.3},
    "yarn-betas-no-truncate": {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
}  # fmt: skip


def ours_scaling(config) -> dict:
    """What the caller hands RotaryEmbedding: HF's standardized rope dict, plus the config's
    max_position_embeddings (longrope / yarn derive `factor` from it when absent)."""
    return {**config.rope_parameters, "max_position_embeddings": config.max_position_embeddings}


def hf_cos_sin(rotary, positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rotary(torch.zeros(1, len(positions), dim), positions[None])
    return cos[0], sin[0]


def qwen3_config(rope: dict) -> Qwen3Config:
    return Qwen3Config(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS, rope_parameters={**rope, "rope_theta": THETA},
    )  # fmt: skip


def phi3_config(partial: float, rope: dict | None = None) -> Phi3Config:
    return Phi3Config(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=MAX_POS, original_max_position_embeddings=ORIG,
        partial_rotary_factor=partial, rope_theta=10_000.0, rope_scaling=rope,
    )  # fmt: skip


def longrope(partial: float, **extra) -> dict:
    # Phi-3 checkpoint layout: legacy "type", original_max_position_embeddings only at the top.
    g = torch.Generator().manual_seed(7)
    n = int(HEAD_DIM * partial) // 2
    return {
        "type": "longrope",
        "short_factor": (1 + torch.rand(n, generator=g)).tolist(),
        "long_factor": (1 + 7 * torch.rand(n, generator=g)).tolist(),
        **extra,
    }


@pytest.mark.parametrize("name", list(QWEN_ROPES))
def test_tables_match_qwen3(name):
    config = qwen3_config(QWEN_ROPES[name])
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, ours_scaling(config), "cpu", torch.float32)
    cos, sin = hf_cos_sin(Qwen3RotaryEmbedding(config), torch.arange(MAX_POS), HEAD_DIM)
    torch.testing.assert_close(rope.cos, cos, atol=ATOL, rtol=0)
    torch.testing.assert_close(rope.sin, sin, atol=ATOL, rtol=0)


def test_yarn_attention_factor_is_applied():
    assert attention_factor(YARN) == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    assert attention_factor({**YARN, "attention_factor": 1.3}) == 1.3
    rope = RotaryEmbedding(HEAD_DIM, 8, THETA, YARN, "cpu", torch.float32)
    assert rope.cos[0].max().item() == pytest.approx(attention_factor(YARN))


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("extra", [{}, {"attention_factor": 1.1}], ids=["derived", "explicit"])
def test_longrope_matches_phi3_short_and_long(partial, extra):
    config = phi3_config(partial, longrope(partial, **extra))
    scaling = ours_scaling(config)
    assert scaling["original_max_position_embeddings"] == ORIG  # moved in from the top level
    rotary_dim = int(HEAD_DIM * partial)
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, 10_000.0, scaling, "cpu", torch.float32)
    assert rope.rotary_dim == rotary_dim and rope.cos.shape == (MAX_POS, rotary_dim)

    # positions < original: HF on a sequence that fits the original context (short_factor)
    cos, sin = hf_cos_sin(Phi3RotaryEmbedding(config), torch.arange(ORIG), rotary_dim)
    torch.testing.assert_close(rope.cos[:ORIG], cos, atol=ATOL, rtol=0)
    torch.testing.assert_close(rope.sin[:ORIG], sin, atol=ATOL, rtol=0)
    # positions >= original: HF on a longer sequence (long_factor for all of it)
    cos, sin = hf_cos_sin(Phi3RotaryEmbedding(config), torch.arange(MAX_POS), rotary_dim)
    torch.testing.assert_close(rope.cos[ORIG:], cos[ORIG:], atol=ATOL, rtol=0)
    torch.testing.assert_close(rope.sin[ORIG:], sin[ORIG:], atol=ATOL, rtol=0)
    assert not torch.allclose(rope.cos[:ORIG], cos[:ORIG])  # the two halves differ in HF


def test_longrope_factor_from_explicit_factor_key():
    base = {**longrope(1.0), "original_max_position_embeddings": ORIG}
    from_ratio = attention_factor({**base, "max_position_embeddings": MAX_POS})
    assert attention_factor({**base, "factor": MAX_POS / ORIG}) == from_ratio
    with pytest.raises(ValueError, match="factor"):
        attention_factor(base)  # neither factor nor max_position_embeddings


def rand_qk(t: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(t, 4, dim, generator=g), torch.randn(t, 2, dim, generator=g)


def hf_rotate(apply_fn, q, k, cos, sin):
    # ours is [T, H, hd]; HF wants [B, H, T, hd] with cos/sin [B, T, rd]
    q2, k2 = apply_fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    return q2[0].transpose(0, 1), k2[0].transpose(0, 1)


@pytest.mark.parametrize("rope_cfg", [None, "longrope"], ids=["default", "longrope"])
def test_partial_rotary_apply_matches_phi3(rope_cfg):
    partial = 0.75
    config = phi3_config(partial, longrope(partial) if rope_cfg else None)
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, 10_000.0, ours_scaling(config), "cpu", torch.float32)
    assert rope.rotary_dim == 48
    positions = torch.tensor([0, 1, 5, 17, 300, ORIG - 1])
    q, k = rand_qk(len(positions), HEAD_DIM)
    cos, sin = hf_cos_sin(Phi3RotaryEmbedding(config), positions, 48)
    hq, hk = hf_rotate(phi3_apply, q, k, cos, sin)
    oq, ok = rope.apply(q, k, positions)
    torch.testing.assert_close(oq, hq, atol=ATOL, rtol=0)
    torch.testing.assert_close(ok, hk, atol=ATOL, rtol=0)
    assert torch.equal(oq[..., 48:], q[..., 48:]) and torch.equal(ok[..., 48:], k[..., 48:])


def test_explicit_rotary_dim_overrides_scaling():
    rope = RotaryEmbedding(HEAD_DIM, 16, THETA, None, "cpu", torch.float32, rotary_dim=32)
    assert rope.rotary_dim == 32 and rope.cos.shape == (16, 32)
    torch.testing.assert_close(
        rope.cos[3, :16], torch.cos(3 * inverse_frequencies(32, THETA, None))
    )


def test_full_rotary_apply_matches_qwen3_yarn():
    config = qwen3_config(YARN)
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, ours_scaling(config), "cpu", torch.float32)
    positions = torch.tensor([0, 2, 3, 900, 2000, MAX_POS - 1])
    q, k = rand_qk(len(positions), HEAD_DIM)
    cos, sin = hf_cos_sin(Qwen3RotaryEmbedding(config), positions, HEAD_DIM)
    hq, hk = hf_rotate(qwen3_apply, q, k, cos, sin)
    oq, ok = rope.apply(q, k, positions)
    torch.testing.assert_close(oq, hq, atol=ATOL, rtol=0)
    torch.testing.assert_close(ok, hk, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 48], ids=["full", "partial"])
def test_rotation_is_transformers_bit_for_bit(rotary_dim, dtype):
    """Given the same cos and sin, the rotation is transformers' apply_rotary_pos_emb to
    the bit (the products rounded before the sums, as it rounds them), also on q and k
    read side by side out of a fused projection's rows, as the decoder rotates them."""
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, None, "cpu", dtype, rotary_dim=rotary_dim)
    positions = torch.tensor([0, 3, 7, 900, 2001, MAX_POS - 1])
    t = len(positions)
    g = torch.Generator().manual_seed(0)
    qkv = (4 * torch.randn(t, 7 * HEAD_DIM, generator=g)).to(dtype)  # 4 q heads, 2 k, 1 v
    qk = qkv[:, : 6 * HEAD_DIM].view(t, 6, HEAD_DIM)
    ours = rope.at(positions).rotate(qk)
    apply_fn = qwen3_apply if rotary_dim == HEAD_DIM else phi3_apply
    hq, hk = hf_rotate(apply_fn, qk[:, :4], qk[:, 4:], rope.cos[positions], rope.sin[positions])
    assert torch.equal(ours[:, :4], hq) and torch.equal(ours[:, 4:], hk)
    assert torch.equal(qkv[:, : 6 * HEAD_DIM].view(t, 6, HEAD_DIM), qk)  # input untouched


def test_tables_computed_in_fp32_then_cast():
    fp32 = RotaryEmbedding(HEAD_DIM, 512, THETA, YARN, "cpu", torch.float32)
    bf16 = RotaryEmbedding(HEAD_DIM, 512, THETA, YARN, "cpu", torch.bfloat16)
    assert bf16.cos.dtype == torch.bfloat16
    assert torch.equal(bf16.cos, fp32.cos.to(torch.bfloat16))
    assert torch.equal(bf16.sin, fp32.sin.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["dynamic", "made-up"])
def test_unknown_rope_type_raises(kind):
    with pytest.raises(ValueError, match="unsupported rope_type"):
        RotaryEmbedding(
            HEAD_DIM, 16, THETA, {"rope_type": kind, "factor": 2.0}, "cpu", torch.float32
        )


@pytest.mark.parametrize("rotary_dim", [0, 31, 66])
def test_bad_rotary_dim_raises(rotary_dim):
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(HEAD_DIM, 16, THETA, None, "cpu", torch.float32, rotary_dim=rotary_dim)


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_proportional_tables_match_gemma4(factor):
    """Gemma 4's full layers: a quarter of the frequency pairs rotated at theta^(-2j/head_dim),
    the rest passed through (sin 0), over the whole head; bit for bit transformers' table."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    scaling = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": factor}
    config = Gemma4TextConfig(
        hidden_size=128, num_hidden_layers=2, head_dim=16, global_head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {**scaling, "rope_theta": THETA}},
    )  # fmt: skip
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, scaling, "cpu", torch.float32, HEAD_DIM)
    positions = torch.arange(MAX_POS)[None]
    cos, sin = Gemma4TextRotaryEmbedding(config)(torch.zeros(1), positions, "full_attention")
    assert torch.equal(rope.cos, cos[0]) and torch.equal(rope.sin, sin[0])
    assert (rope.sin[:, HEAD_DIM // 8 : HEAD_DIM // 2] == 0).all()
