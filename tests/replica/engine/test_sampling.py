"""Per-row sampling features of the engine against Hugging Face transformers + PEFT (fp32, CPU):
logprobs, prompt logprobs, penalties / logit_bias / min_tokens / min_p, n choices (forked KV),
structured output, request validation and abort."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from pydantic import ValidationError

from replica.engine.engine import LLMEngine
from replica.engine.sequence import SeqStatus, Sequence, SequenceGroup
from replica.errors import RequestError
from replica.model.kv_cache import KVCache
from replica.model.sampler import choice_seed
from replica.wire import GenerateRequest, Reply, SamplingParams, StructuredOutput, TokenLogprobs
from tests.engines import make_engine
from tests.oracle import hf_logits, hf_model

TOL = 1e-4  # logprobs: engine fp32 vs HF fp32
EOS = 2
# greedy from this prompt repeats tokens (base: 80, 450, 465) and, on the base model and
# adapters 01 and 03, each penalty changes its output
REPEATING = [49, 31, 266, 391, 351, 299, 351, 135, 414, 192]
Request = tuple[list[int], SamplingParams, str | None]


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompts(seed: int, *lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny matmuls: on a shared 2-core box extra threads only contend (20x slower)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf(tiny):
    """adapter name (None: base) -> the HF model, loaded once."""
    models = {}

    def get(adapter: str | None):
        if adapter not in models:
            models[adapter] = hf_model(tiny.model_dir, adapter and tiny.adapters[adapter])
        return models[adapter]

    return get


Emitted = list[tuple[SequenceGroup, Reply]]  # every reply of every step, with its request


def drain(eng: LLMEngine, max_steps: int = 2000) -> Emitted:
    outputs = []
    for _ in range(max_steps):
        if not eng.has_work():
            return outputs
        outputs += [(group, r) for group, replies in eng.step().items() for r in replies]
    raise AssertionError(f"not finished within {max_steps} steps")


def run(eng: LLMEngine, requests: list[Request]) -> tuple[list[Sequence], Emitted]:
    seqs = [eng.add_request(GenerateRequest(*r)) for r in requests]
    return seqs, drain(eng)


def of(outputs: Emitted, seq: Sequence) -> list[Reply]:
    """The replies of `seq`'s choice, in step order."""
    return [r for group, r in outputs if group is seq.group and r.index == seq.index]


def alone(tiny, requests: list[Request]) -> list[list[list[int]]]:
    """Each request run by itself on a fresh engine: its choices' outputs."""
    eng = make_engine(tiny)
    return [[c.output_ids for c in eng.generate([r])[0].choices] for r in requests]


def assert_top(got: TokenLogprobs, row: torch.Tensor, k: int) -> None:
    """got.top is row's k best, best first, ids equal to HF's topk."""
    top = row.topk(k)
    assert [t for t, _ in got.top] == top.indices.tolist()
    values = [lp for _, lp in got.top]
    assert values == sorted(values, reverse=True)
    assert all(abs(v - w) <= TOL for v, w in zip(values, top.values.tolist()))


def assert_logprobs(model, prompt: list[int], seq: Sequence, k: int) -> None:
    """seq.logprobs[i] is log_softmax of HF's logits at the position that drew output i."""
    out, p = seq.output_ids, len(prompt)
    lps = torch.log_softmax(hf_logits(model, prompt + out), -1)[p - 1 : p - 1 + len(out)]
    assert len(seq.logprobs) == len(out)
    for row, token, got in zip(lps, out, seq.logprobs):
        assert got.token_id == token
        assert abs(got.logprob - row[token].item()) <= TOL
        assert_top(got, row, k)
        if seq.sampling.greedy and seq.sampling.plain:
            assert token == row.argmax().item()


def assert_prompt_logprobs(model, prompt: list[int], got: tuple, k: int) -> None:
    """Entry 0 None; entry i: log_softmax(HF logits[i - 1])[prompt[i]] and the top k."""
    lps = torch.log_softmax(hf_logits(model, prompt), -1)
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        assert got[i].token_id == prompt[i]
        assert abs(got[i].logprob - lps[i - 1, prompt[i]].item()) <= TOL
        assert_top(got[i], lps[i - 1], k)


# -- 1. logprobs -------------------------------------------------------------------------------


def test_logprobs_equal_hf_log_softmax_in_a_mixed_batch(tiny, hf):
    p = prompts(1, 7, 13, 5, 20, 9, 11)
    reqs = [
        (p[0], greedy(logprobs=5), None),
        (p[1], greedy(logprobs=3), "adapter-01"),
        (p[2], greedy(), None),
        (p[3], greedy(), "adapter-02"),
        # a sampled row: logprobs are of the raw logits whatever the draw
        (p[4], SamplingParams(seed=5, max_tokens=8, ignore_eos=True, logprobs=0), "adapter-03"),
        (p[5], SamplingParams(seed=6, max_tokens=8, ignore_eos=True), None),
    ]
    seqs, outputs = run(make_engine(tiny), reqs)
    for seq, (prompt, sp, adapter) in zip(seqs, reqs):
        emitted = of(outputs, seq)
        assert [o.token_ids for o in emitted] == [(t,) for t in seq.output_ids]  # one a step
        assert len(seq.output_ids) == 8
        if sp.logprobs is None:
            assert not seq.logprobs and all(o.logprobs == () for o in emitted)
        else:
            assert [lp for o in emitted for lp in o.logprobs] == seq.logprobs
            assert_logprobs(hf(adapter), prompt, seq, sp.logprobs)
    # asking for logprobs changes no row's tokens, its own or its neighbours'
    assert [[s.output_ids] for s in seqs] == alone(tiny, reqs)


# -- 2. prompt logprobs ------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [None, 8], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_hf(tiny, hf, budget):
    eng = make_engine(tiny, **({"max_num_batched_tokens": budget} if budget else {}))
    p = prompts(2, 21, 17, 6, 12)
    reqs = [
        (p[0], SamplingParams(max_tokens=0, prompt_logprobs=4), None),
        (p[1], greedy(3, prompt_logprobs=2, logprobs=1, n=2), "adapter-02"),
        (p[3], SamplingParams(max_tokens=0, prompt_logprobs=0), "adapter-00"),
    ]
    # a plain request decoding meanwhile: its sampled rows come before the scored ones
    plain = eng.add_request(GenerateRequest(p[2], greedy(12), None))
    eng.step()
    seqs = [eng.add_request(GenerateRequest(*r)) for r in reqs]
    outputs = drain(eng)
    for seq, (prompt, sp, adapter) in zip(seqs, reqs):
        emitted = of(outputs, seq)
        assert emitted[0].prompt_logprobs is not None  # with the first output, only there
        assert all(o.prompt_logprobs is None for o in emitted[1:])
        assert all(o.prompt_logprobs is None for c in seq.choices[1:] for o in of(outputs, c))
        assert_prompt_logprobs(hf(adapter), prompt, emitted[0].prompt_logprobs, sp.prompt_logprobs)
        if sp.max_tokens == 0:  # echo scoring: one output, no token
            assert [(o.token_ids, o.finish_reason) for o in emitted] == [((), "length")]
            assert seq.finish_reason == "length" and seq.output_ids == []
        else:
            for c in seq.choices:
                assert len(c.output_ids) == sp.max_tokens
                assert_logprobs(hf(adapter), prompt, c, sp.logprobs)
    assert plain.output_ids == alone(tiny, [(p[2], greedy(12), None)])[0][0]
    assert eng.scheduler.allocator.num_free == eng.scheduler.allocator.num_blocks
    if budget:  # steps that score prompt positions and sample no row at all
        seqs, outputs = run(make_engine(tiny, max_num_batched_tokens=budget), reqs[:1])
        first = outputs[0][1]
        assert first.prompt_logprobs is not None
        assert_prompt_logprobs(hf(None), p[0], first.prompt_logprobs, 4)


# -- 3. penalties, logit_bias, min_tokens, min_p -----------------------------------------------


@torch.no_grad()
def reference(model, prompt: list[int], sp: SamplingParams) -> list[int]:
    """Greedy over HF logits with vLLM's order of processing: logit_bias, min_tokens (EOS and
    stop tokens masked), repetition penalty (prompt + output), presence / frequency (output)."""
    out: list[int] = []
    while len(out) < sp.max_tokens:
        x = hf_logits(model, prompt + out)[-1].clone()
        for token, bias in sp.logit_bias:
            x[token] += bias
        if len(out) < sp.min_tokens:
            x[list(sp.stop_token_ids) + ([] if sp.ignore_eos else [EOS])] = float("-inf")
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt + out)))
            y = x[seen]
            x[seen] = torch.where(y > 0, y / sp.repetition_penalty, y * sp.repetition_penalty)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[0])
        x -= sp.presence_penalty * (counts > 0) + sp.frequency_penalty * counts
        token = int(x.argmax())
        out.append(token)
        if token in sp.stop_token_ids or (not sp.ignore_eos and token == EOS):
            break
    return out


# (params, adapter, the unprocessed params it must differ from)
PROCESSED = [
    # logprobs: of the raw logits, before the penalty
    (greedy(12, repetition_penalty=1.8, logprobs=3), None, greedy(12)),
    (greedy(12, repetition_penalty=1.5), "adapter-01", greedy(12)),
    (greedy(12, repetition_penalty=0.7), None, greedy(12)),  # < 1 encourages repeats
    (greedy(12, presence_penalty=1.5), None, greedy(12)),
    (greedy(12, frequency_penalty=1.0), None, greedy(12)),
    (greedy(12, presence_penalty=1.5, frequency_penalty=-0.2), "adapter-03", greedy(12)),
    (greedy(12, logit_bias=((450, -100.0), (106, 4.0))), None, greedy(12)),
    # the second greedy token (106) as a stop token: masked for the first 4 tokens
    (
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(106,), min_tokens=4),
        None,
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(106,)),
    ),
    # EOS biased to win at once, masked (bias or not) until min_tokens
    (
        SamplingParams(temperature=0, max_tokens=12, min_tokens=5, logit_bias=((EOS, 30.0),)),
        "adapter-02",
        SamplingParams(temperature=0, max_tokens=12, logit_bias=((EOS, 30.0),)),
    ),
    # all at once; EOS wins as soon as min_tokens allows it
    (
        SamplingParams(
            temperature=0,
            max_tokens=12,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logit_bias=((EOS, 50.0), (80, 3.0)),
            min_tokens=8,
        ),
        "adapter-03",
        greedy(12),
    ),
]


def test_penalties_bias_and_min_tokens_equal_the_reference_loop(tiny, hf):
    other = prompts(3, 14)[0]
    plain = [
        (REPEATING, greedy(12), None),
        (other, greedy(12), "adapter-01"),
        (other, SamplingParams(seed=9, max_tokens=12, ignore_eos=True), None),
    ]
    reqs = [(REPEATING, sp, adapter) for sp, adapter, _ in PROCESSED]
    # processed and plain rows share every step
    seqs, _ = run(make_engine(tiny), [*reqs, *plain])
    for seq, (sp, adapter, unprocessed) in zip(seqs, PROCESSED):
        want = reference(hf(adapter), REPEATING, sp)
        assert seq.output_ids == want, sp
        assert want != reference(hf(adapter), REPEATING, unprocessed), f"no effect: {sp}"
        if sp.logprobs is not None:
            assert_logprobs(hf(adapter), REPEATING, seq, sp.logprobs)
    plain_out = [s.output_ids for s in seqs[len(reqs) :]]
    assert plain_out[:2] == [reference(hf(a), p, sp) for p, sp, a in plain[:2]]
    assert [[o] for o in plain_out] == alone(tiny, plain)


def test_min_p_drops_tokens_below_its_share_of_the_top(tiny, hf):
    def probs(sp: SamplingParams) -> list[float]:
        """Per choice and position: p(token) / p(top) at the draw's temperature."""
        seq = make_engine(tiny).generate([(REPEATING, sp, None)])[0]
        ratios = []
        for c in seq.choices:
            x = hf_logits(hf(None), REPEATING + c.output_ids)[len(REPEATING) - 1 : -1]
            p = torch.softmax(x / sp.temperature, -1)
            drawn = p.gather(-1, torch.tensor(c.output_ids)[:, None])[:, 0]
            ratios += (drawn / p.amax(-1)).tolist()
        return ratios

    sp = SamplingParams(temperature=2.0, seed=1, n=8, max_tokens=6, ignore_eos=True, min_p=0.3)
    assert min(probs(sp)) >= 0.3 * (1 - 1e-3)
    assert min(probs(sp.model_copy(update={"min_p": 0.0}))) < 0.3  # min_p made the difference


# -- 4. n choices ------------------------------------------------------------------------------

SEEDED = SamplingParams(seed=11, n=3, max_tokens=10, ignore_eos=True, logprobs=2)


def choice_outputs(seq: Sequence) -> list[list[int]]:
    assert [c.index for c in seq.choices] == list(range(seq.sampling.n))
    assert all(c.status is SeqStatus.FINISHED for c in seq.choices)
    return [c.output_ids for c in seq.choices]


def test_n_seeded_choices_reproducible_batch_independent_and_forked(tiny, hf):
    prompt = prompts(4, 13)[0]
    first = choice_outputs(run(make_engine(tiny), [(prompt, SEEDED, "adapter-01")])[0][0])
    assert len({tuple(o) for o in first}) == 3, "choices should differ"

    # another engine, arriving while other requests prefill and decode
    eng = make_engine(tiny, max_num_batched_tokens=16)
    others = [(p, SamplingParams(seed=i, max_tokens=9), a) for i, (p, a) in enumerate(
        zip(prompts(5, 9, 30, 4), [None, "adapter-01", "adapter-02"])
    )]  # fmt: skip
    eng.add_request(GenerateRequest(*others[0]))
    eng.step()
    eng.add_request(GenerateRequest(*others[1]))
    seq = eng.add_request(GenerateRequest(prompt, SEEDED, "adapter-01"))
    eng.add_request(GenerateRequest(*others[2]))
    drain(eng)
    assert choice_outputs(seq) == first
    for c in seq.choices:  # forked rows' logprobs too
        assert_logprobs(hf("adapter-01"), prompt, c, 2)

    # choice i draws what an n = 1 request seeded with its derived seed draws (the KV copy
    # of the prompt serves its decodes as its own prefill would)
    singles = [
        (prompt, SEEDED.model_copy(update={"n": 1, "seed": choice_seed(11, i)}), "adapter-01")
        for i in range(3)
    ]
    assert [[o] for o in first] == alone(tiny, singles)


def test_n_greedy_choices_are_identical_to_n_1(tiny):
    prompt = prompts(6, 10)[0]
    seq = make_engine(tiny).generate([(prompt, greedy(10, n=3), "adapter-02")])[0]
    assert choice_outputs(seq) == 3 * alone(tiny, [(prompt, greedy(10), "adapter-02")])[0]


@pytest.mark.parametrize("scarce", ["kv_blocks", "max_num_seqs"])
def test_n_choices_finish_when_forks_must_wait(tiny, scarce):
    # 10 + 8 tokens: 5 blocks of 4 per choice. After the prefill choice 0 holds 3 blocks,
    # 2 of them full (shared by the forks): each fork needs 1 block (a copy of the partly
    # filled one), so with 5 blocks 2 of the 3 forks start and the third waits
    per_block = KVCache.bytes_per_block(make_engine(tiny).spec, 4, torch.float32)
    kw = {"block_size": 4, "kv_cache_bytes": 5 * per_block}
    if scarce == "max_num_seqs":
        kw = {"max_num_seqs": 2}
    eng = make_engine(tiny, **kw)
    prompt = prompts(7, 10)[0]
    sp = SEEDED.model_copy(update={"max_tokens": 8, "logprobs": None, "n": 4})
    seq = eng.add_request(GenerateRequest(prompt, sp, None))
    while not seq.group.forked:
        eng.step()
    assert any(c in eng.scheduler.waiting for c in seq.choices[1:]), "no fork waited"
    drain(eng)
    if scarce == "kv_blocks":
        assert eng.scheduler.num_preemptions > 0  # the choices' decodes then take turns
    assert choice_outputs(seq) == alone(tiny, [(prompt, sp, None)])[0]
    assert all(c.finish_reason == "length" for c in seq.choices)
    assert eng.scheduler.allocator.num_free == eng.scheduler.allocator.num_blocks
    assert not eng.sampler._draws


# -- 5. structured output ----------------------------------------------------------------------

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},  # a random model never ends a string
            "age": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"enum": ["red", "green", "blue"]},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
]


def structured(kind: str, schema: dict | None = None, **kw) -> SamplingParams:
    spec = StructuredOutput(kind=kind, json_schema=schema and json.dumps(schema))
    return SamplingParams(max_tokens=60, structured_output=spec, **kw)


def test_structured_output_follows_the_json_schema(tiny):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny.model_dir)
    # the demo tokenizer is byte-level BPE: it can spell any JSON
    assert tokenizer.decode(tokenizer.encode('{"a": [12, true]}')) == '{"a": [12, true]}'
    reqs = [
        ([1, 100 + 7 * seed, 200, 300], structured("json_schema", schema, seed=seed, n=n), None)
        for schema in SCHEMAS
        for seed, n in ((0, 1), (1, 2))  # n = 2: each fork has its own grammar state
    ]
    # json_object: an object of anything; a bias towards '"' ends the random model's strings
    # (seeds whose members end within max_tokens)
    quote = tokenizer.convert_tokens_to_ids('"')
    reqs += [
        ([1, 50 + seed], structured("json_object", seed=seed, logit_bias=((quote, 10.0),)), a)
        for seed, a in ((0, None), (8, "adapter-01"), (9, None), (9, "adapter-01"))
    ]
    seqs = make_engine(tiny).generate(reqs)
    special = set(tokenizer.all_special_ids)
    for seq, (_, sp, _) in zip(seqs, reqs):
        for c in seq.choices:
            assert c.finish_reason == "stop" and c.output_ids[-1] == EOS, c
            # no special token inside: the router's decode would drop it from the JSON
            assert not special & set(c.output_ids[:-1]), c.output_ids
            text = tokenizer.decode(c.output_ids[:-1])
            value = json.loads(text)
            so = sp.structured_output
            if so.kind == "json_schema":
                jsonschema.validate(value, json.loads(so.json_schema))
            else:  # an object, without free whitespace (a model cannot pad it forever)
                assert isinstance(value, dict) and text == json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize("schema", ['{"type": "nonsense"}', '{"type": "object"', None])
def test_invalid_json_schema_is_refused_at_add_request(tiny, schema):
    eng = make_engine(tiny)
    sp = SamplingParams(structured_output=StructuredOutput(kind="json_schema", json_schema=schema))
    with pytest.raises(RequestError):
        eng.add_request(GenerateRequest([1, 2, 3], sp))
    assert not eng.has_work()


# -- 6. request validation ---------------------------------------------------------------------


def test_logit_bias_outside_the_vocabulary_is_refused(tiny):
    eng = make_engine(tiny)
    with pytest.raises(RequestError, match="logit_bias"):
        eng.add_request(
            GenerateRequest([5, 6], SamplingParams(logit_bias=((eng.spec.vocab_size, 1.0),)))
        )
    assert not eng.has_work()


@pytest.mark.parametrize(
    "bad",
    [
        {"logprobs": 21},
        {"prompt_logprobs": 21},
        {"logprobs": -1},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.1},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": 10.5},
        {"min_p": 1.5},
        {"min_tokens": 5, "max_tokens": 3},
        {"min_tokens": -1},
        {"n": 0},
        {"n": 17},
        {"logit_bias": ((3, 101.0),)},
        {"logit_bias": ((3, 1.0), (3, 2.0))},
        {"logit_bias": ((-1, 1.0),)},
        {"max_tokens": 0},
    ],
)
def test_sampling_params_validation(bad):
    with pytest.raises(ValidationError):
        SamplingParams(**bad)


# -- 7. abort ----------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["prefilling", "decoding"])
def test_abort_of_n_choices_frees_every_block_and_sampler_state(tiny, when):
    eng = make_engine(tiny, max_num_batched_tokens=8)
    sched, sampler = eng.scheduler, eng.sampler
    sp = SamplingParams(seed=3, n=3, max_tokens=20, repetition_penalty=1.2, ignore_eos=True)
    prompt, other = prompts(8, 20, 5)
    seq = eng.add_request(GenerateRequest(prompt, sp, "adapter-00"))
    neighbour = eng.add_request(GenerateRequest(other, greedy(30), None))
    while seq.num_computed == 0:  # its adapter loads, then its first chunk
        eng.step()
    if when == "decoding":
        while not seq.group.forked:
            eng.step()
        eng.step()
        assert all(c.status is SeqStatus.RUNNING for c in seq.choices)
        assert len(sampler._draws) == 3 and len(sampler.counts._rows) == 3
    else:
        assert not seq.group.forked and seq.status is SeqStatus.RUNNING
    eng.abort(seq.choices[1])  # any choice ends the whole request
    assert all(c.finish_reason == "abort" and not c.blocks for c in seq.choices)
    assert all(c not in sched.waiting and c not in sched.running for c in seq.choices)
    assert not sampler._draws and not sampler.counts._rows
    drain(eng)
    assert neighbour.finish_reason == "length"
    assert sched.allocator.num_free == sched.allocator.num_blocks
    assert all(slot.refs == 0 for slot in sched.pool.slots)
