"""Driving an engine's decode steps by hand: prompts, requests brought to decode, the next
step's plan, a static decode path built on the CPU, and the Triton kernels a warm-up compiles."""

from __future__ import annotations

from replica.engine.engine import LLMEngine
from replica.engine.scheduler import plan_step
from replica.executor.static_decode import StaticDecode
from replica.wire import GenerateRequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def prompt(i: int, n: int) -> list[int]:
    return [(13 * i + 7 * j) % 300 + 3 for j in range(n)]


def decoding(eng: LLMEngine, requests: list[tuple[int, str | None]]) -> None:
    """Add (prompt length, adapter) requests and step until every one is decoding."""
    seqs = [
        eng.add_request(GenerateRequest(prompt(i, n), GREEDY, a))
        for i, (n, a) in enumerate(requests)
    ]
    for _ in range(200):
        if all(s.output_ids for s in seqs):
            return
        eng.step()
    raise AssertionError("the requests did not reach decode")


def next_plan(eng: LLMEngine):
    """The plan of the engine's next step (a decode-only one here), without running it."""
    work = eng.scheduler.schedule().ordered()
    plan, _, _ = plan_step(work, eng.config.block_size)
    assert not plan.prefill_starts
    return plan, work


def static_for(eng: LLMEngine, max_num_seqs: int) -> StaticDecode:
    runner = eng.executor
    runner.slot_tensors.update(runner.lora.table)
    return runner.make_static_decode(max_num_seqs)


def triton_kernels() -> list:
    from kernels import (
        attention_triton,
        gated_delta_triton,
        moe_triton,
        sgmv_triton,
    )

    return [
        sgmv_triton._shrink_kernel,
        sgmv_triton._expand_kernel,
        sgmv_triton._shrink_bgmv_kernel,
        sgmv_triton._expand_bgmv_kernel,
        attention_triton._paged_decode_kernel,
        attention_triton._merge_splits_kernel,
        attention_triton._prefill_kernel,
        moe_triton._grouped_gemm_kernel,
        gated_delta_triton._conv_kernel,  # a hybrid model's linear attention
        gated_delta_triton._recurrent_kernel,
        gated_delta_triton._chunked_kernel,
    ]
