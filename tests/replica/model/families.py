"""What the family tests share: their prompts, the engine they build, the oracle's logit
tolerance, a recorder of the fixed-shape decode step, and the MoE routers' margin."""

from __future__ import annotations

import torch

from replica.engine.engine import LLMEngine
from replica.wire import SamplingParams
from tests.engines import make_engine
from tests.oracle import hf_logits

LOGIT_ATOL = 2e-4  # our fp32 logits against transformers' eager fp32
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def prompts(vocab: int) -> list[list[int]]:
    """Return a 5- and a 40-token prompt drawn from [3, vocab), the same on every call."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 40)]


def engine_for(model_dir, adapters: dict, **kw) -> LLMEngine:
    """Return a CPU engine on a family's model with `adapters` loaded, in 4-token blocks
    and 16-token steps, so that the 23- and 40-token prompts prefill in chunks."""
    return make_engine(model_dir, adapters, block_size=4, max_num_batched_tokens=16, **kw)


def check_base_unchanged_beside_adapters(model_dir, adapters: dict, **kw) -> None:
    """Check that base requests are untouched by adapters: with 16 (copies of `adapters`)
    loaded, their greedy ids and logprobs are bit-identical to an engine's with none
    loaded, when they run alone and when the 16 run in their batches, while the 16's
    outputs differ from the base model's.

    Beside the adapters, the reference runs the same batches: the base requests plus 16
    base-model companions in place of the adapters' requests (same prompts and sampling),
    so every step has the same rows and each base row's GEMMs round the same way; a LoRA
    path that wrote into other rows would show in the last bits. Prefix caching is off in
    both engines: the companions would reuse the base requests' blocks where the
    adapters' requests cannot, and the batches would differ. `kw`: the engines'
    EngineConfig fields."""
    kw = {**kw, "enable_prefix_caching": False}
    paths = list(adapters.values())
    many = {f"a{i}": paths[i % len(paths)] for i in range(16)}
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    ps = prompts(256)
    base = [(p, sampling, None) for p in ps]
    beside = [(ps[i % 2], sampling, name) for i, name in enumerate(many)]
    companions = [(p, s, None) for p, s, _ in beside]
    plain = engine_for(model_dir, {}, **kw)
    want_alone, want = plain.generate(base), plain.generate(base + companions)
    crowd = engine_for(model_dir, many, **kw)
    # the 16 made resident first: a load still in flight (they overlap, timed by the
    # machine's load) would hold its requests back a step, and the batches would differ
    crowd.generate(beside)
    assert all(crowd.adapters.tier(name) == "device" for name in many)
    alone, got = crowd.generate(base), crowd.generate(base + beside)
    n = len(ps)
    assert [s.output_ids for s in alone] == [s.output_ids for s in want_alone]
    assert [s.logprobs for s in alone] == [s.logprobs for s in want_alone]
    assert [s.output_ids for s in got[:n]] == [s.output_ids for s in want[:n]]
    assert [s.logprobs for s in got[:n]] == [s.logprobs for s in want[:n]]
    assert any(g.output_ids != w.output_ids for g, w in zip(got[n:], want[n:]))


def traced_static_decode(runner, max_seqs: int) -> tuple[list[int], list[str]]:
    """Make `runner` take its fixed-shape decode step (the one CUDA graphs replay) for up
    to `max_seqs` sequences and record it: (one entry per step it ran, the device values
    those steps read)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    runner.static_decode = runner.make_static_decode(max_seqs)
    used: list[int] = []
    reads: list[str] = []

    class ScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func.overloadpacket) in ("aten._local_scalar_dense", "aten.item"):
                reads.append(str(func))
            return func(*args, **(kwargs or {}))

    real_run = runner.static_decode.run

    def traced(*a):
        used.append(1)
        with ScalarReads():
            return real_run(*a)

    runner.static_decode.run = traced
    return used, reads


MARGIN = 1e-4  # smallest k-th vs (k+1)-th router logit gap: our hidden states match
# transformers' to ~1e-5, so no expert choice can flip


def router_margin(model, prompt: list[int], k: int) -> float:
    """Return the smallest gap between the k-th and (k+1)-th router logit of any token and
    layer over the prompt (transformers; the softmax keeps their order)."""
    gaps = []

    def hook(_module, _args, out):
        logits = out[0].float().sort(dim=-1, descending=True).values
        gaps.append((logits[:, k - 1] - logits[:, k]).min().item())

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules()
               if n.endswith(("mlp.gate", "mlp.router")) and hasattr(m, "top_k")]  # fmt: skip
    try:
        hf_logits(model, prompt)
    finally:
        for h in handles:
            h.remove()
    assert gaps, "no router ran"
    return min(gaps)
