"""`lorafleet bench http`: load against a running server through its OpenAI API.

The client side of a serving benchmark: it sees what a user sees (TTFT, inter-token
latency, end-to-end time over streamed SSE) and reads the server's adapter-load counters
before and after, so a routing or caching change shows up as fewer loads per request.
`--json PATH` writes every figure printed.

Two scenarios share prompt prefixes, for the prefix cache: shared-prefix (each adapter
has its own long system prompt, each request adds a unique user message) and multi-turn
(conversations whose every turn repeats the previous turn's prompt and answer). Each
request records the usage's prompt_tokens and prompt_tokens_details.cached_tokens; the
summary's prefix_hit_rate is their ratio, the server's from its prefix counters.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np

from cluster.bench.stats import PERCENTILES, ms, percentiles

SCENARIOS = ("uniform", "zipf", "distinct", "bursty", "mixed-base", "shared-prefix", "multi-turn")
API_KEY_ENV = "LORAFLEET_API_KEY"
PREFIX_COUNTERS = ("prefix_queried_tokens", "prefix_hit_tokens")  # replica telemetry
MAX_ERRORS_SHOWN = 5

# Short common words: with a leading space most tokenizers make each one a single token,
# so a prompt of N words is about N tokens.
WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "hot word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find"
).split()

# The prefix scenarios' words: those of WORDS that the demo tokenizer keeps as one token
# with a leading space (a test checks it; of all of WORDS it makes ~1.6 tokens a word), as
# common BPE vocabularies do, so that N of them are N tokens and --prefix-tokens is tokens.
ONE_TOKEN_WORDS = (
    "the of and to in is was for on are with as be at have this from or had by but what we "
    "can out other were all there when up use said an time if way about write so long make "
    "see has look more day go come number no people know water call first find"
).split()
PROMPT_TOKENS = 128  # the default prompt length; shared-prefix: SUFFIX_TOKENS after the prefix
SUFFIX_TOKENS = 32


class BenchError(Exception):
    """A problem with the target server or the options: reported in one line, no traceback."""


@dataclass
class LoadOptions:
    """One load run. `num_requests` and `duration_s` bound it; at least one must be set."""

    url: str = "http://127.0.0.1:8000"
    adapters: int | None = None  # the first N registered adapters by name; None: all of them
    scenario: str = "uniform"
    base_fraction: float = 0.5  # mixed-base only
    zipf_alpha: float = 1.0  # zipf only
    phases: int = 4  # bursty only: the adapters split into this many disjoint sets
    phase_requests: int = 32  # bursty only: requests in a row drawn from one set
    rate: float | None = None  # Poisson arrivals per second; None: closed loop at `concurrency`
    concurrency: int = 16  # multi-turn: conversations in flight
    num_requests: int | None = 256  # multi-turn: turns
    warmup_requests: int = 0  # sent first, same scenario; not measured, loads not counted
    duration_s: float | None = None  # stop issuing after this long
    grace_s: float = 10.0  # after duration_s, requests still running get this long, then cancel
    prompt_tokens: int | None = None  # None: SUFFIX_TOKENS for shared-prefix, else PROMPT_TOKENS
    prefix_tokens: int = 1000  # shared-prefix: words (~tokens) of each adapter's system prompt
    turns: int = 4  # multi-turn: turns per conversation, each sent when the last one answered
    max_tokens: int = 64
    seed: int = 0
    timeout_s: float = 300.0  # per request, start to [DONE]
    stats_settle_s: float = 2.0  # replicas publish their counters periodically (about 1 s)
    label: str | None = None
    api_key: str | None = None  # sent as a bearer token (a server with api_key_for_inference)

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise BenchError(f"unknown scenario {self.scenario!r}; choose from {SCENARIOS}")
        if self.prompt_tokens is None:
            shared = self.scenario == "shared-prefix"
            self.prompt_tokens = SUFFIX_TOKENS if shared else PROMPT_TOKENS
        if self.num_requests is None and self.duration_s is None:
            raise BenchError("give num_requests or duration_s: a load run must be bounded")
        if not 0.0 <= self.base_fraction <= 1.0:
            raise BenchError(f"base_fraction {self.base_fraction} is not in [0, 1]")
        if self.rate is not None and self.rate <= 0:
            raise BenchError(f"rate {self.rate} must be positive")
        if self.concurrency < 1 or self.max_tokens < 1 or self.prompt_tokens < 1:
            raise BenchError("concurrency, max_tokens and prompt_tokens must be at least 1")
        if self.phases < 1 or self.phase_requests < 1:
            raise BenchError("phases and phase_requests must be at least 1")
        if self.warmup_requests < 0:
            raise BenchError(f"warmup_requests {self.warmup_requests} must not be negative")
        if self.adapters is not None and self.adapters < 0:
            raise BenchError(f"adapters {self.adapters} must not be negative")
        if self.prefix_tokens < 1 or self.turns < 1:
            raise BenchError("prefix_tokens and turns must be at least 1")
        if self.scenario == "multi-turn" and self.rate is not None:
            raise BenchError("multi-turn runs closed loop (--concurrency conversations)")


@dataclass
class Answer:
    """What a streamed completion answered: its text and, from a server that returns them
    (return_token_ids), the prompt's and the generated token ids."""

    text: str = ""
    prompt_ids: list[int] | None = None
    token_ids: list[int] | None = None

    @property
    def has_ids(self) -> bool:
        return self.prompt_ids is not None and self.token_ids is not None

    @property
    def num_ids(self) -> int:
        return len(self.prompt_ids or ()) + len(self.token_ids or ())


@dataclass
class RequestRecord:
    """What one request saw, in seconds from the moment it was sent."""

    index: int
    model: str
    is_base: bool
    ttft_s: float | None = None  # first SSE chunk carrying text
    itl_s: list[float] = field(default_factory=list)  # gaps between later text chunks
    e2e_s: float | None = None  # to [DONE]
    output_tokens: int = 0
    status: int | None = None
    error: str | None = None
    cancelled: bool = False  # still running at duration_s + grace_s
    prompt_tokens: int | None = None  # the usage's; None: the server sent no usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not sent
    conversation: int | None = None  # multi-turn: which conversation, which turn (from 0)
    turn: int | None = None
    # multi-turn: the previous turn's tokens this prompt repeats exactly (turn 0: 0): its
    # prompt and generated ids when the server returns ids, else its prompt
    context_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled and self.e2e_s is not None


@dataclass
class LoadResult:
    options: LoadOptions
    base_model: str
    adapters: list[str]
    records: list[RequestRecord]
    wall_s: float
    counters: dict[str, dict[str, float]] | None  # per replica, during the run; None: unknown
    warmup: list[RequestRecord] = field(default_factory=list)  # before the counters were read

    def summary(self) -> dict:
        """Every figure, JSON-ready: metrics under "all", "base" and "adapter"."""
        return {
            "label": self.options.label,
            "options": asdict(self.options),
            "base_model": self.base_model,
            "adapters": self.adapters,
            "wall_s": self.wall_s,
            "warmup": {
                "requests": len(self.warmup),
                "ok": sum(r.ok for r in self.warmup),
                "requests_per_model": dict(Counter(r.model for r in self.warmup)),
            },
            "requests_per_model": dict(Counter(r.model for r in self.records)),
            "errors": self.first_errors(),
            "all": _group(self.records, self.wall_s),
            "base": _group([r for r in self.records if r.is_base], self.wall_s),
            "adapter": _group([r for r in self.records if not r.is_base], self.wall_s),
            **_server_side(self.counters),
        }

    def first_errors(self) -> list[str]:
        messages = dict.fromkeys(r.error for r in self.records if r.error is not None)
        return list(messages)[:MAX_ERRORS_SHOWN]


def _server_side(counters: dict[str, dict[str, float]] | None) -> dict:
    """Adapter loads per replica and in all; the shares of adapter requests that found their
    adapter in a device slot or in host memory on arrival; step time blocked on loads; the
    share of prompt tokens looked up in the prefix cache that it held (None where the
    replicas report no prefix counters)."""
    if counters is None:
        return {"adapter_loads": {"total": None, "per_replica": None}, "server": None}
    loads = {rid: int(c["adapter_loads"]) for rid, c in counters.items()}
    total = {
        k: sum(c.get(k, 0) for c in counters.values()) for k in next(iter(counters.values()), {})
    }
    lookups = sum(total.get(f"lookups_{t}", 0) for t in ("device", "host", "miss"))
    queried = total.get("prefix_queried_tokens")
    return {
        "adapter_loads": {"total": sum(loads.values()), "per_replica": loads},
        "server": {
            "device_hit_rate": total.get("lookups_device", 0) / lookups if lookups else None,
            "host_hit_rate": total.get("lookups_host", 0) / lookups if lookups else None,
            "load_wait_s": total.get("load_wait_s", 0.0),
            "prefix_queried_tokens": queried,
            "prefix_hit_tokens": total.get("prefix_hit_tokens"),
            "prefix_hit_rate": total.get("prefix_hit_tokens", 0) / queried if queried else None,
        },
    }


# -- CLI ----------------------------------------------------------------------------------------

QUICK = {"num_requests": 16, "max_tokens": 4, "prompt_tokens": 16, "concurrency": 4}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = LoadOptions
    p.add_argument("--url", help=f"Server base URL (default {d.url}).")
    p.add_argument("--adapters", type=int,
                   help="Use the first N registered adapters by name (default: all); "
                        "shared-prefix and multi-turn with 0 run on the base model.")  # fmt: skip
    p.add_argument("--scenario", choices=SCENARIOS,
                   help="Which model each request names: uniform over adapters, zipf-skewed, "
                        "distinct (round-robin), bursty (phases of disjoint adapter sets), "
                        "mixed-base; or, for the prefix cache, shared-prefix (uniform, each "
                        "adapter's own system prompt before a unique message) or multi-turn "
                        "(conversations on one adapter each, every turn the previous prompt "
                        f"+ answer + a new message) (default {d.scenario}).")  # fmt: skip
    p.add_argument("--prefix-tokens", type=int,
                   help=f"shared-prefix: each adapter's system prompt length (default "
                        f"{d.prefix_tokens}).")  # fmt: skip
    p.add_argument("--turns", type=int,
                   help=f"multi-turn: turns per conversation (default {d.turns}).")  # fmt: skip
    p.add_argument("--phases", type=int,
                   help=f"bursty: disjoint adapter sets (default {d.phases}).")  # fmt: skip
    p.add_argument("--phase-requests", type=int,
                   help=f"bursty: requests per phase (default {d.phase_requests}).")  # fmt: skip
    p.add_argument("--base-fraction", type=float,
                   help=f"mixed-base: share of requests to the base model (default "
                        f"{d.base_fraction}).")  # fmt: skip
    p.add_argument(
        "--zipf-alpha",
        type=float,
        help=f"zipf: adapter i weighs 1/(i+1)^alpha (default {d.zipf_alpha}).",
    )
    arrivals = p.add_mutually_exclusive_group()
    arrivals.add_argument("--rate", type=float, help="Poisson arrivals at R requests/s.")
    arrivals.add_argument("--concurrency", type=int,
                          help=f"Closed loop: C requests (multi-turn: conversations) in flight "
                               f"(default {d.concurrency}, used when --rate is not "
                               "given).")  # fmt: skip
    p.add_argument("--num-requests", type=int,
                   help=f"Requests (multi-turn: turns) to send (default {d.num_requests}; "
                        "unbounded when only --duration-s is given).")  # fmt: skip
    p.add_argument("--duration-s", type=float, help="Stop issuing requests after this long.")
    p.add_argument("--warmup-requests", type=int,
                   help="Send this many requests of the same scenario first, unmeasured: adapter "
                        "loads are counted after them, so a run measures the steady state, not "
                        "the cold start (default 0).")  # fmt: skip
    p.add_argument("--grace-s", type=float,
                   help=f"After --duration-s, cancel requests still running after this long "
                        f"(default {d.grace_s}).")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int,
                   help=f"Approximate prompt length; shared-prefix: the message after the "
                        f"prefix, multi-turn: each turn's message (default {PROMPT_TOKENS}, "
                        f"shared-prefix {SUFFIX_TOKENS}).")  # fmt: skip
    p.add_argument(
        "--max-tokens", type=int, help=f"Output tokens per request (default {d.max_tokens})."
    )
    p.add_argument("--seed", type=int, help=f"Seeds prompts, models, arrivals (default {d.seed}).")
    p.add_argument("--timeout-s", type=float,
                   help=f"Per-request limit (default {d.timeout_s}).")  # fmt: skip
    p.add_argument("--stats-settle-s", type=float,
                   help="Wait before reading the server's counters after the run, so replicas "
                        f"have published them (default {d.stats_settle_s}).")  # fmt: skip
    p.add_argument("--label", help="Name of this run in the output.")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"Bearer token of a secured server (default: ${API_KEY_ENV}).")  # fmt: skip
    quick = ", ".join(f"{k} {v}" for k, v in QUICK.items())
    p.add_argument("--quick", action="store_true", help=f"A few-second smoke run: {quick}.")
    p.add_argument("--json", type=Path, default=None, help="Write every figure here.")


def options_from_args(args: argparse.Namespace) -> LoadOptions:
    """Defaults < --quick < explicit flags; --duration-s alone means no request-count bound."""
    given = {
        name: getattr(args, name)
        for name in LoadOptions.__dataclass_fields__
        if getattr(args, name, None) is not None
    }
    base = dict(QUICK) if args.quick else {}
    if args.duration_s is not None and args.num_requests is None:
        base["num_requests"] = None
    return LoadOptions(**{**base, **given})


def run(args: argparse.Namespace) -> int:
    try:
        options = options_from_args(args)
        print(_header(options))
        result = asyncio.run(run_load(options))
    except BenchError as e:
        print(f"lorafleet: error: {e}", file=sys.stderr)
        return 2
    report = result.summary()
    _print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    if report["all"]["requests"] and not report["all"]["ok"]:
        first = report["errors"][0] if report["errors"] else "no error recorded"
        print(f"lorafleet: error: every request failed; the first: {first}", file=sys.stderr)
        return 1
    return 0


# -- the run ------------------------------------------------------------------------------------


async def run_load(options: LoadOptions) -> LoadResult:
    """Discover models, read counters, send the load, wind down, read counters again."""
    url = options.url.rstrip("/")
    timeout = httpx.Timeout(options.timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: a proxy from the environment would be measured along with the server.
    headers = {} if options.api_key is None else {"Authorization": f"Bearer {options.api_key}"}
    async with httpx.AsyncClient(
        timeout=timeout, limits=limits, trust_env=False, headers=headers
    ) as client:
        base, adapters = await discover_models(client, url, options.adapters)
        pick = request_picker(options, base, adapters)
        drive = _drive_conversations if options.scenario == "multi-turn" else _drive
        warmup: list[RequestRecord] = []
        if options.warmup_requests:
            warm = replace(options, num_requests=options.warmup_requests, duration_s=None)
            warmup = await drive(client, url, warm, pick, base)
            await asyncio.sleep(options.stats_settle_s)  # the warm-up's loads reach the counters
        before = await read_replica_counters(client, url)
        start = time.perf_counter()
        records = await drive(client, url, options, pick, base, first_index=len(warmup))
        wall = time.perf_counter() - start
        counters = None
        if before is not None:
            await asyncio.sleep(options.stats_settle_s)
            after = await read_replica_counters(client, url)
            if after is not None:
                counters = counter_deltas(before, after)
    return LoadResult(options, base, adapters, records, wall, counters, warmup)


async def discover_models(
    client: httpx.AsyncClient, url: str, n: int | None
) -> tuple[str, list[str]]:
    """The base model (parent null) and the first n adapters by name."""
    try:
        r = await client.get(f"{url}/v1/models")
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise BenchError(f"GET {url}/v1/models: HTTP {r.status_code}: {_error_message(r)}")
    cards = r.json()["data"]
    bases = [c["id"] for c in cards if c.get("parent") is None]
    if len(bases) != 1:
        raise BenchError(f"{url}/v1/models lists {len(bases)} base models (parent null), not 1")
    adapters = sorted(c["id"] for c in cards if c.get("parent") is not None)
    if n is not None and len(adapters) < n:
        raise BenchError(f"--adapters {n}: the server has only {len(adapters)} registered")
    return bases[0], adapters[:n]


async def read_replica_counters(
    client: httpx.AsyncClient, url: str
) -> dict[str, dict[str, float]] | None:
    """Cumulative counters per replica (adapter loads; where arriving adapter requests found
    their adapter; step time blocked on loads; prompt tokens looked up in the prefix cache
    and found there, where the replicas count them); None where the server does not expose
    them."""
    try:
        r = await client.get(f"{url}/v1/lorafleet/stats")
        if r.status_code != 200:
            return None
        counters = {}
        for rid, s in r.json()["replicas"].items():
            t = s.get("telemetry", {})
            lookups = t.get("lookups", {})
            counters[rid] = {
                "adapter_loads": int(s.get("adapter_loads", 0)),
                **{f"lookups_{tier}": lookups.get(tier, 0) for tier in ("device", "host", "miss")},
                "load_wait_s": t.get("load_wait_seconds", 0.0),
                **{k: t[k] for k in PREFIX_COUNTERS if k in t},
            }
        return counters
    except (httpx.HTTPError, ValueError, KeyError, AttributeError):
        return None


def counter_deltas(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """after - before per replica and counter (a replica new since `before` counts from 0)."""
    return {
        rid: {k: v - before.get(rid, {}).get(k, 0) for k, v in counts.items()}
        for rid, counts in after.items()
    }


def request_picker(options: LoadOptions, base: str, adapters: list[str]) -> Callable[[int], str]:
    """The model request i names, deterministic for a seed."""
    scenario = options.scenario
    if not adapters and scenario in ("shared-prefix", "multi-turn"):
        return lambda i: base  # --adapters 0: the base model's prefixes
    if not adapters and not (scenario == "mixed-base" and options.base_fraction == 1.0):
        raise BenchError(f"scenario {scenario!r} needs at least one adapter")
    rng = random.Random(options.seed)
    if scenario in ("uniform", "shared-prefix", "multi-turn"):  # multi-turn: i a conversation
        return lambda i: rng.choice(adapters)
    if scenario == "zipf":
        weights = [1.0 / (k + 1) ** options.zipf_alpha for k in range(len(adapters))]
        return lambda i: rng.choices(adapters, weights)[0]
    if scenario == "distinct":
        return lambda i: adapters[i % len(adapters)]
    if scenario == "bursty":  # the working set moves: phase k draws from set k mod phases only
        sets = [s for s in (adapters[k :: options.phases] for k in range(options.phases)) if s]
        return lambda i: rng.choice(sets[(i // options.phase_requests) % len(sets)])
    return lambda i: base if rng.random() < options.base_fraction else rng.choice(adapters)


def build_prompt(i: int, n_tokens: int, seed: int) -> str:
    """About n_tokens words; request i's own words from the start, so no prefix is cached."""
    rng = random.Random(f"{seed}-{i}")
    return f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(max(0, n_tokens - 2)))


def _one_token_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(ONE_TOKEN_WORDS) for _ in range(n))


def system_prompt(model: str, n_tokens: int, seed: int) -> str:
    """The model's own system prompt of n_tokens one-token words (plus "System:"): the same
    for every request naming the model, another for each model."""
    return f"System: {_one_token_words(random.Random(f'{seed}-system-{model}'), n_tokens)}"


def user_message(tag: str, n_tokens: int, seed: int) -> str:
    """One user turn of about n_tokens words, unique to its tag, ending where the answer
    starts."""
    words = _one_token_words(random.Random(f"{seed}-user-{tag}"), max(0, n_tokens - 2))
    return f"User: {tag}: {words}\nAssistant:"


def shared_prefix_prompt(model: str, i: int, options: LoadOptions) -> str:
    """shared-prefix request i: the model's system prompt, then a user message of its own
    after a newline (BPE pre-tokenizers split there, so the system prompt's tokens are the
    same in every request naming the model)."""
    prefix = system_prompt(model, options.prefix_tokens, options.seed)
    return f"{prefix}\n{user_message(str(i), options.prompt_tokens, options.seed)}"


def next_turn_prompt(previous_prompt: str, previous_answer: str, message: str) -> str:
    """A multi-turn turn's prompt as text (for servers that do not return token ids): the
    previous turn's prompt and answer, exactly as sent and streamed, a newline, the new
    user message; the first turn's is the message alone.

    So the previous prompt is a prefix of this one, and its tokens are too: it ends in
    "Assistant:", where BPE pre-tokenizers end a word whatever the answer starts with. The
    answer's text, tokenized again, need not give the ids the model generated (with the
    demo tokenizer, 10 of 300 random 32-token outputs did): the engine's cached blocks of
    generated tokens then miss, and what a turn can reuse is the previous prompt. Servers
    that return token ids (return_token_ids) get the conversation as ids instead
    (next_turn_ids), as a client that keeps them would send it."""
    if not previous_prompt:
        return message
    return f"{previous_prompt}{previous_answer}\n{message}"


def next_turn_ids(previous: Answer, message_ids: list[int]) -> list[int]:
    """A multi-turn turn's prompt as token ids: the previous turn's prompt and generated
    ids, then the new message's: all of the previous turn is an exact prefix (what a
    real model's answer, tokenized again, mostly gives too)."""
    return [*(previous.prompt_ids or []), *(previous.token_ids or []), *message_ids]


def request_prompt(options: LoadOptions, model: str, i: int) -> str:
    """The prompt of request i (every scenario but multi-turn, which builds its turns)."""
    if options.scenario == "shared-prefix":
        return shared_prefix_prompt(model, i, options)
    return build_prompt(i, options.prompt_tokens, options.seed)


async def _drive(
    client: httpx.AsyncClient,
    url: str,
    options: LoadOptions,
    pick: Callable[[int], str],
    base: str,
    first_index: int = 0,
) -> list[RequestRecord]:
    """Issue requests (Poisson or closed loop) until a bound, then wind down. Request
    indices (which seed prompts and models) start at first_index."""
    start = time.perf_counter()
    deadline = start + options.duration_s if options.duration_s is not None else float("inf")
    slots = asyncio.Semaphore(options.concurrency) if options.rate is None else None
    arrivals = random.Random(options.seed + 1)
    next_at = start
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    for i in _indices(first_index, options.num_requests):  # bounded by count or deadline
        if slots is not None:
            if not await _acquire(slots, deadline):
                break
        elif next_at >= deadline:
            break
        else:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            next_at += arrivals.expovariate(options.rate)
        if time.perf_counter() >= deadline:
            break
        model = pick(i)
        record = RequestRecord(i, model, model == base)
        records.append(record)
        prompt = request_prompt(options, model, i)
        task = asyncio.create_task(_send(client, url, options, record, prompt))
        if slots is not None:
            task.add_done_callback(lambda _: slots.release())
        tasks.append(task)
    await _wind_down(tasks, deadline + options.grace_s)
    return records


async def _drive_conversations(
    client: httpx.AsyncClient,
    url: str,
    options: LoadOptions,
    pick: Callable[[int], str],
    base: str,
    first_index: int = 0,
) -> list[RequestRecord]:
    """multi-turn: `concurrency` conversations at a time, each of `turns` turns sent one
    after the other (a turn when the previous one's stream has ended), on one model each.
    num_requests counts turns; duration_s stops new turns. Request indices and
    conversation numbers start at first_index (a warm-up's conversations had fewer)."""
    deadline = time.perf_counter() + (
        options.duration_s if options.duration_s is not None else float("inf")
    )
    left = [options.num_requests if options.num_requests is not None else float("inf")]
    conversations, indices = itertools.count(first_index), itertools.count(first_index)
    records: list[RequestRecord] = []

    async def converse() -> None:
        # bounded: every conversation takes at least one turn from `left`
        while left[0] > 0 and time.perf_counter() < deadline:
            conversation = next(conversations)
            model = pick(conversation)
            prompt: str | list[int] = ""
            answer, context = Answer(), 0
            for turn in range(options.turns):
                if left[0] <= 0 or time.perf_counter() >= deadline:
                    return
                left[0] -= 1
                record = RequestRecord(next(indices), model, model == base,
                                       conversation=conversation, turn=turn,
                                       context_tokens=context)  # fmt: skip
                records.append(record)
                message = user_message(f"{conversation}.{turn}", options.prompt_tokens,
                                       options.seed)  # fmt: skip
                if answer.has_ids:  # the server returns ids: the conversation goes on in ids
                    ids = await _tokenize(client, url, model, "\n" + message, record)
                    if ids is None:
                        break
                    prompt = next_turn_ids(answer, ids)
                else:
                    prompt = next_turn_prompt(str(prompt), answer.text, message)
                answer = await _send(client, url, options, record, prompt)
                if not record.ok:
                    break  # no answer to go on from: a new conversation
                context = answer.num_ids if answer.has_ids else record.prompt_tokens

    workers = [asyncio.create_task(converse()) for _ in range(options.concurrency)]
    await _wind_down(workers, deadline + options.grace_s)
    return records


def _indices(first: int, num_requests: int | None) -> Iterator[int]:
    if num_requests is None:
        return itertools.count(first)
    return iter(range(first, first + num_requests))


async def _acquire(slots: asyncio.Semaphore, deadline: float) -> bool:
    """A free slot, or False once the deadline passes first."""
    timeout = None if deadline == float("inf") else max(0.0, deadline - time.perf_counter())
    try:
        await asyncio.wait_for(slots.acquire(), timeout)
    except asyncio.TimeoutError:
        return False
    return True


async def _wind_down(tasks: list[asyncio.Task], cutoff: float) -> None:
    """Let requests finish until the cutoff, then cancel the rest (they mark themselves)."""
    if not tasks:
        return
    timeout = None if cutoff == float("inf") else max(0.0, cutoff - time.perf_counter())
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def _tokenize(
    client: httpx.AsyncClient, url: str, model: str, text: str, record: RequestRecord
) -> list[int] | None:
    """`text`'s token ids by the server's /tokenize (no special tokens); None, with the
    error in `record`, if it fails."""
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    try:
        r = await client.post(f"{url}/tokenize", json=body)
        if r.status_code == 200:
            return list(r.json()["tokens"])
        record.error = f"tokenize: HTTP {r.status_code}: {_error_message(r)}"
    except (httpx.HTTPError, ValueError, KeyError) as e:
        record.error = f"tokenize: {type(e).__name__}: {e}"
    return None


async def _send(
    client: httpx.AsyncClient,
    url: str,
    options: LoadOptions,
    record: RequestRecord,
    prompt: str | list[int],
) -> Answer:
    """One request into its record; the answer (empty when it failed)."""
    body = {
        "model": record.model,
        "prompt": prompt,
        "max_tokens": options.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.scenario == "multi-turn":  # vLLM's extension: the ids to go on from
        body["return_token_ids"] = True
    try:
        streamed = stream_completion(client, f"{url}/v1/completions", body, record)
        return await asyncio.wait_for(streamed, options.timeout_s)
    except asyncio.CancelledError:
        record.cancelled = True
        raise
    except asyncio.TimeoutError:
        record.error = f"timeout after {options.timeout_s} s"
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        record.error = f"{type(e).__name__}: {e}"
    return Answer()


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict, record: RequestRecord
) -> Answer:
    """One streamed completion, timed chunk by chunk into the record; its answer."""
    t0 = time.perf_counter()
    text_times: list[float] = []
    texts: list[str] = []
    answer = Answer()
    usage_tokens = None
    async with client.stream("POST", url, json=body) as r:
        record.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            record.error = f"HTTP {r.status_code}: {_error_message(r)}"
            return answer
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                record.e2e_s = time.perf_counter() - t0
                break
            chunk = json.loads(data)
            if "error" in chunk:  # after the 200 header, errors come as an event
                record.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                return answer
            if chunk.get("usage"):
                usage = chunk["usage"]
                usage_tokens = usage["completion_tokens"]
                record.prompt_tokens = usage.get("prompt_tokens")
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens"
                )
            choices = chunk.get("choices") or []
            if choices and choices[0].get("prompt_token_ids") is not None:
                answer.prompt_ids = list(choices[0]["prompt_token_ids"])
            if choices and choices[0].get("token_ids") is not None:
                answer.token_ids = [*(answer.token_ids or []), *choices[0]["token_ids"]]
            if choices and choices[0].get("text"):
                text_times.append(time.perf_counter())
                texts.append(choices[0]["text"])
    if record.e2e_s is None:
        record.error = "the stream ended without [DONE]"
        return answer
    if text_times:
        record.ttft_s = text_times[0] - t0
        record.itl_s = np.diff(text_times).tolist()
    # Servers that ignore include_usage: count text chunks instead.
    record.output_tokens = usage_tokens if usage_tokens is not None else len(text_times)
    answer.text = "".join(texts)
    return answer


def _error_message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


# -- figures and printing -----------------------------------------------------------------------


def _group(records: list[RequestRecord], wall_s: float) -> dict:
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        **_group_head(records, ok, tokens, wall_s),
        **prefix_figures(ok),
        **percentiles([r.ttft_s for r in ok if r.ttft_s is not None], "ttft"),
        **percentiles([gap for r in ok for gap in r.itl_s], "itl"),
        **percentiles([r.e2e_s for r in ok], "e2e"),
    }


def _group_head(
    records: list[RequestRecord], ok: list[RequestRecord], tokens: int, wall_s: float
) -> dict:
    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": sum(r.error is not None for r in records),
        "cancelled": sum(r.cancelled for r in records),
        "output_tokens": tokens,
        "req_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_tok_per_s": tokens / wall_s if wall_s > 0 else 0.0,
    }


def prefix_figures(records: list[RequestRecord]) -> dict:
    """The prefix cache as the client saw it: prompt and cached tokens summed over the
    requests whose usage gave both, and prefix_hit_rate = cached / prompt (None where no
    usage carried cached_tokens: a server without prefix caching may leave the field out).
    previous_prompt_share (multi-turn): the previous turns' repeated tokens (context_tokens)
    over the prompt tokens, what reusing exactly the previous turns would reach, block
    rounding aside."""
    counted = [r for r in records if r.prompt_tokens is not None and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in counted)
    cached = sum(r.cached_tokens for r in counted)
    turns = [r for r in records if r.context_tokens is not None and r.prompt_tokens is not None]
    turn_prompt = sum(r.prompt_tokens for r in turns)
    return {
        "prompt_tokens": sum(r.prompt_tokens for r in records if r.prompt_tokens is not None),
        "cached_tokens": cached if counted else None,
        "prefix_hit_rate": cached / prompt if prompt else None,
        "previous_prompt_share": (
            sum(r.context_tokens for r in turns) / turn_prompt if turn_prompt else None
        ),
    }


def _header(o: LoadOptions) -> str:
    arrivals = f"Poisson {o.rate} req/s" if o.rate is not None else f"{o.concurrency} concurrent"
    bounds = [f"{o.num_requests} requests"] if o.num_requests is not None else []
    bounds += [f"{o.duration_s} s"] if o.duration_s is not None else []
    name = f" [{o.label}]" if o.label else ""
    warmup = f" after {o.warmup_requests} warm-up requests" if o.warmup_requests else ""
    size = f"~{o.prompt_tokens}+{o.max_tokens} tokens"
    if o.scenario == "shared-prefix":
        size = f"~{o.prefix_tokens} (shared) + {size}"
    elif o.scenario == "multi-turn":
        arrivals = f"{o.concurrency} concurrent conversations"
        size = f"{o.turns} turns each adding {size}"
    return (
        f"http bench{name}: {o.url}, scenario {o.scenario}, {arrivals}, "
        f"{' or '.join(bounds)}{warmup}, {size}"
    )


def _print_report(report: dict) -> None:
    quantiles = "/".join(f"p{q}" for q in PERCENTILES)
    cols = ["requests", "ok", "failed", "cancel", "req/s", "tok/s"]
    print(f"{'':<8}" + "".join(f"{c:>9}" for c in cols)
          + "".join(f"{m + ' ms ' + quantiles:>23}" for m in ("TTFT", "ITL", "E2E")))  # fmt: skip
    for kind in ("all", "base", "adapter"):
        g = report[kind]
        row = [str(g[k]) for k in ("requests", "ok", "failed", "cancelled")]
        row += [f"{g['req_per_s']:.2f}", f"{g['output_tok_per_s']:.1f}"]
        cells = [
            "/".join(ms(g[f"{m}_p{q}_s"]) for q in PERCENTILES) for m in ("ttft", "itl", "e2e")
        ]
        print(f"{kind:<8}" + "".join(f"{c:>9}" for c in row) + "".join(f"{c:>23}" for c in cells))
    loads = report["adapter_loads"]
    if loads["per_replica"] is None:
        print("adapter loads: unknown (no counters at /v1/lorafleet/stats)")
    else:
        per = ", ".join(f"{r} {n}" for r, n in sorted(loads["per_replica"].items()))
        print(f"adapter loads: {loads['total']} ({per})")
        server = report["server"]
        if server["device_hit_rate"] is not None:
            print(
                f"adapter found on arrival: in a device slot {server['device_hit_rate']:.0%}, "
                f"in host memory only {server['host_hit_rate']:.0%}; step time blocked on "
                f"loads {server['load_wait_s']:.3f} s"
            )
    prefix = _prefix_line(report)
    if prefix:
        print(prefix)
    for message in report["errors"]:
        print(f"error: {message}")


def _prefix_line(report: dict) -> str | None:
    """The prefix cache's line: for the prefix scenarios always, else where it hit."""
    a, server = report["all"], report["server"] or {}
    client, served = a["prefix_hit_rate"], server.get("prefix_hit_rate")
    scenario = report["options"]["scenario"]
    if scenario not in ("shared-prefix", "multi-turn") and not (a["cached_tokens"] or served):
        return None
    if a["cached_tokens"] is None:
        line = "prefix cache: hit rate unknown client-side (no usage.prompt_tokens_details)"
    else:
        line = (
            f"prefix cache: hit rate {_pct(client)} client-side "
            f"({a['cached_tokens']} of {a['prompt_tokens']} prompt tokens cached)"
        )
    line += f", {_pct(served)} server-side" if served is not None else ", server: no counters"
    if a["previous_prompt_share"] is not None:
        line += f"; previous turns: {_pct(a['previous_prompt_share'])} of prompt tokens"
    return line


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"
