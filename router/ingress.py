"""The HTTP face: an OpenAI-compatible FastAPI ingress deployment.

Validates bodies, resolves `model` to the base model or a registered adapter,
tokenizes (chat template for chat), calls a LoRAReplica through its handle (the
request router picks which) and turns the token stream into text: incremental
detokenization, stop strings, SSE chunks. No tensors here.

By job: `http_app` (the FastAPI app, error bodies, middlewares), `adapter_routes` (what
models a caller sees and names, load/unload), `streams` (the replicas' reply streams, whole
answers and SSE), `tenancy` (keys, scopes, quotas, metering); this
module the service endpoints, tokenization and the generation path.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from replica.wire import AdapterInfo, AdapterKey, GenerateRequest
from router import extra_protocol as xp
from router import protocol as p
from router import streams
from router.adapter_routes import AdapterRoutes, Catalog
from router.choices import LogprobFormatter, Prompt, RequestOutput, TextOptions
from router.errors import APIError, BadRequestError, ServiceUnavailableError
from router.http_app import AUTHORIZATION, app, log, refuse_invalid_unicode
from router.metrics import PROMETHEUS_TEXT, IngressMetrics, export_urls, scrape
from router.model_defaults import sampling_defaults
from router.options import IngressOptions
from router.responses_api import answer as ra
from router.responses_api import request as rq
from router.streams import Streams, own_request_id
from router.tenancy import Caller, Lease, Tenancy
from router.tools.message import ChatAnswers
from router.tools.template import ChatTemplate, Templates, answer_parser

__all__ = ["Ingress", "ServedIngress", "app"]

# The replica owns a request's deadline; the ingress's waits (for the store to find an
# adapter, for a replica to take the call) trail it by this much.
DEADLINE_GRACE_S = 2.0
# /health: a replica counts as serving while its last report to the AdapterStore is younger
# than this. Replicas report every routing stats period (1 s by default), from their
# engine's loop thread, so a dead engine stops reporting; Serve's own routing-stats timeout
# is 5 periods, and a loaded CPU engine can take seconds per step.
HEALTH_MAX_REPORT_AGE_S = 10.0
HEALTH_TIMEOUT_S = 5.0  # for the AdapterStore's answer
# apply_chat_template's own parameters: chat_template_kwargs may only add template variables
_TEMPLATE_PARAMETERS = frozenset(
    inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
) - {"kwargs"}

# Everything the Ingress methods use is defined above the class: serve.ingress copies the
# methods with the module globals of that moment, and only those their code names: so
# request and response models are named through a module their code uses (p., xp.), an
# annotation alone would not resolve in the replica.


def _sampling(
    body: p.CompletionRequest | p.ChatCompletionRequest,
    default_max_tokens: int | None,
    model_defaults: Mapping[str, Any],
) -> Any:
    """The request's SamplingParams; fields valid alone but not together are a 400.
    Completions with echo and logprobs also score the prompt (max_tokens 0: only that)."""
    prompt_logprobs = None
    if isinstance(body, p.CompletionRequest) and body.echo:
        prompt_logprobs = body.logprobs
        if prompt_logprobs is None and body.max_tokens == 0:
            prompt_logprobs = 0  # nothing to generate: the prefill is the whole request
    try:
        return body.sampling_params(default_max_tokens, model_defaults, prompt_logprobs)
    except ValidationError as e:
        raise BadRequestError(p.format_validation_errors(e.errors())) from None
    except ValueError as e:
        raise BadRequestError(str(e)) from None


def _context_length(model_dir: str, tokenizer: Any) -> int:
    """The model's context length (config.json), else the tokenizer's model_max_length."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int):
            return config[key]
    limit = getattr(tokenizer, "model_max_length", 0)
    return limit if isinstance(limit, int) and limit < 2**31 else 0


def _serving_replicas(reports: Mapping[str, Mapping[str, Any]], max_age_s: float) -> list[str]:
    """The replicas whose last report (AdapterStore.replica_stats) is recent enough."""
    return [rid for rid, stats in reports.items() if stats.get("age_s", max_age_s) < max_age_s]


def _token_charge(prompts: list[Prompt], sampling: Any, n: int, max_model_len: int) -> int:
    """What a request may use at most, its tokens quota charge: every prompt, and
    max_tokens (default: the rest of the context) for each of its n choices."""
    total = 0
    for prompt in prompts:
        new = sampling.max_tokens
        if new is None:
            new = max(0, max_model_len - len(prompt.ids))
        total += len(prompt.ids) + n * new
    return total


class Ingress(AdapterRoutes):
    def __init__(
        self,
        replicas: DeploymentHandle,
        store: DeploymentHandle,
        model_dir: str,
        served_model_name: str,
        options: IngressOptions | None = None,
        ledger: Any = None,
        listing_period_s: float = 1.0,
    ) -> None:
        """`replicas`, `store` and `ledger` are DeploymentHandles (LoRAReplica,
        AdapterStore, TenantLedger; without a ledger, tenants get one of this process).
        `listing_period_s`: how often the store's listing is refreshed (the routing stats
        period, at which replicas report what they hold)."""
        self.replicas = replicas.options(stream=True)
        self.store = store
        self.model_dir = model_dir
        self.model_name = served_model_name
        self.options = options = options or IngressOptions()
        self.catalog = Catalog(store, listing_period_s)
        self.default_max_tokens = options.default_max_tokens
        self.model_defaults = sampling_defaults(model_dir)  # generation_config.json
        key = options.api_key or os.environ.get(options.api_key_env) or None
        self.tenancy = Tenancy(options, key, ledger)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.max_model_len = _context_length(model_dir, self.tokenizer)
        self.logprob_formatter = LogprobFormatter(self.tokenizer)
        base_template = ChatTemplate.chosen(
            self.tokenizer.chat_template, "tokenizer", options.tool_parser, options.reasoning_parser
        )
        self.templates = Templates(base_template, options.adapter_parsers)
        self.created = int(time.time())
        self.metrics = IngressMetrics()
        self._models_tag, self._models_bodies = None, {}

    # -- service -------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        """200 while some replica can serve: one whose engine reported lately (no
        generation is sent); 503 when none is running or every engine is down."""
        try:
            reports = await asyncio.wait_for(self.store.replica_stats.remote(), HEALTH_TIMEOUT_S)
        except Exception as e:  # the store restarting: nothing tells us about the replicas
            raise ServiceUnavailableError(f"the adapter store did not answer: {e!r}") from None
        if not _serving_replicas(reports, HEALTH_MAX_REPORT_AGE_S):
            raise ServiceUnavailableError(
                f"no replica can serve: none has reported in the last "
                f"{HEALTH_MAX_REPORT_AGE_S:g} s (none running, or their engines are down)"
            )
        return {"status": "ok"}

    @app.get("/v1/lorafleet/stats")
    async def stats(self, authorization: str | None = AUTHORIZATION) -> dict[str, Any]:
        """Per-replica counters (adapter loads, residency, queue) and the store's own; they
        name the adapters, so they need the key where /v1/models does (the admin's, with
        tenants)."""
        self.tenancy.identify(authorization, admin=self.tenancy.enabled)
        return {
            "replicas": await self.store.replica_stats.remote(),
            "store": await self.store.stats.remote(),
        }

    @app.get("/v1/lorafleet/usage")
    async def usage(self, authorization: str | None = AUTHORIZATION) -> dict[str, Any]:
        """Requests and tokens since start per tenant and per model: the admin key reads
        every tenant's, a tenant's key its own."""
        caller = self.tenancy.identify(authorization, admin=not self.tenancy.enabled)
        return await self.tenancy.usage(caller)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def export_metrics(self) -> PlainTextResponse:
        """The lorafleet metrics of every node (ingress and replicas), Prometheus text, as
        Ray's metrics agents export them."""
        urls = await asyncio.to_thread(export_urls)
        return PlainTextResponse(await scrape(urls), media_type=PROMETHEUS_TEXT)

    # -- tokenizer (vLLM's endpoints) ----------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(
        self, body: xp.TokenizeRequest, authorization: str | None = AUTHORIZATION
    ) -> xp.TokenizeResponse:
        """The token ids a completion (prompt) or chat request (messages) would send."""
        caller = self.tenancy.identify(authorization)
        refuse_invalid_unicode(body)
        info = None if body.model is None else await self._resolve_info(body.model, caller)
        if body.messages is not None:
            chat = p.ChatCompletionRequest.model_construct(
                messages=body.messages, tools=body.tools, tool_choice=None
            )
            _, ids = self._chat_prompt(
                self._template(info),
                chat,
                body.add_generation_prompt is not False,
                body.chat_template_kwargs,
                add_special_tokens=bool(body.add_special_tokens),
            )
        else:
            ids = self._text_prompt_ids(body.prompt or "", body.add_special_tokens is not False)
        return xp.TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    @app.post("/detokenize")
    async def detokenize(
        self, body: xp.DetokenizeRequest, authorization: str | None = AUTHORIZATION
    ) -> xp.DetokenizeResponse:
        """Token ids to text, special tokens included (as vLLM's)."""
        caller = self.tenancy.identify(authorization)
        refuse_invalid_unicode(body)
        if body.model is not None:
            await self._resolve(body.model, caller)
        vocab = len(self.tokenizer)
        unknown = [t for t in body.tokens if not 0 <= t < vocab]
        if unknown:
            shown = ", ".join(map(str, unknown[:8])) + (", ..." if len(unknown) > 8 else "")
            raise BadRequestError(
                f"tokens: unknown token ids ({shown}); the vocabulary is 0..{vocab - 1}", "tokens"
            )
        return xp.DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens))

    def _text_prompt_ids(self, prompt: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]

    def _template(self, info: AdapterInfo | None) -> ChatTemplate:
        """The chat template (and parsers) of the base model or an adapter version."""
        if info is None:
            return self.templates.base
        return self.templates.of(info.name, info.version, info.path)

    def _chat_prompt(
        self,
        template: ChatTemplate,
        chat: p.ChatCompletionRequest,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
        add_special_tokens: bool = False,  # the template writes BOS itself
    ) -> tuple[str, list[int]]:
        """The rendered conversation (its tools included) and its token ids. Template
        variables (chat_template_kwargs, reasoning_effort) the template does not read are
        a 400: they would change nothing."""
        kwargs = dict(template_kwargs or {})
        if reserved := sorted(_TEMPLATE_PARAMETERS.intersection(kwargs)):
            raise BadRequestError(
                f"chat_template_kwargs: {', '.join(reserved)} cannot be set here",
                "chat_template_kwargs",
            )
        tools = chat.template_tools()
        try:
            if kwargs or chat.reasoning_effort is not None:
                kwargs = self._template_variables(template, tools, kwargs, chat.reasoning_effort)
            text = template.render(
                self.tokenizer, chat.chat_messages(), tools, add_generation_prompt, kwargs
            )
        except BadRequestError:
            raise
        except Exception as e:  # a template may reject a conversation (roles, order)
            raise BadRequestError(f"chat template: {e}", "messages") from None
        return text, self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def _template_variables(
        self,
        template: ChatTemplate,
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        reasoning_effort: str | None,
    ) -> dict[str, Any]:
        """`kwargs` with reasoning_effort added, each checked to be read by the template."""
        reads = template.variables(self.tokenizer, tools)
        which = "tokenizer's" if template.source == "tokenizer" else template.source
        if unread := sorted(set(kwargs) - reads):
            raise BadRequestError(
                f"chat_template_kwargs: the chat template ({which}) reads no {', '.join(unread)}",
                "chat_template_kwargs",
            )
        if reasoning_effort is None:
            return kwargs
        if "reasoning_effort" not in reads:
            raise BadRequestError(
                f"reasoning_effort: the chat template ({which}) reads no reasoning_effort "
                "(gpt-oss's does); a model's own switch, if it has one, goes in "
                "chat_template_kwargs",
                "reasoning_effort",
            )
        if kwargs.setdefault("reasoning_effort", reasoning_effort) != reasoning_effort:
            raise BadRequestError(
                "reasoning_effort: differs from chat_template_kwargs.reasoning_effort",
                "reasoning_effort",
            )
        return kwargs

    # -- generation ----------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(
        self, body: p.CompletionRequest, authorization: str | None = AUTHORIZATION
    ) -> Any:
        start = time.perf_counter()
        caller = self.tenancy.identify(authorization)
        refuse_invalid_unicode(body)
        return await self._serve(
            body, functools.partial(self._completion_prompts, body), False, start, caller
        )

    def _completion_prompts(
        self, body: p.CompletionRequest, _: AdapterInfo | None
    ) -> tuple[list[Prompt], None]:
        prompts = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                ids = self._text_prompt_ids(prompt, body.add_special_tokens is not False)
            else:
                ids = list(prompt)
            echo = None
            if body.echo:  # token prompts echo as their text
                echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
            prompts.append(Prompt(ids, echo))
        return prompts, None

    @app.post("/v1/chat/completions")
    async def chat_completions(
        self, body: p.ChatCompletionRequest, authorization: str | None = AUTHORIZATION
    ) -> Any:
        start = time.perf_counter()
        caller = self.tenancy.identify(authorization)
        refuse_invalid_unicode(body)
        return await self._serve(
            body, functools.partial(self._chat_prompts, body), True, start, caller
        )

    @app.post("/v1/responses")
    async def create_response(
        self, body: rq.ResponsesRequest, authorization: str | None = AUTHORIZATION
    ) -> Any:
        """OpenAI's Responses API, stateless: the chat path under another shape."""
        start = time.perf_counter()
        caller = self.tenancy.identify(authorization)
        refuse_invalid_unicode(body)
        try:
            chat = rq.ResponsesRequest.chat_request(body)
        except ValidationError as e:
            raise BadRequestError(*p.validation_error(e.errors())) from None
        prepare = functools.partial(self._chat_prompts, chat)
        return await self._serve(chat, prepare, True, start, caller, ra.ResponsesFront(body))

    def _chat_prompts(
        self, body: p.ChatCompletionRequest, info: AdapterInfo | None
    ) -> tuple[list[Prompt], ChatAnswers]:
        """The conversation's prompt through the model's (or adapter's) template, and
        how its answers read (tool calls, thinking)."""
        template = self._template(info)
        mode = body.tool_mode()
        if mode == "auto" and template.tool_parser is None:
            raise BadRequestError(
                f"tool_choice auto: {body.model!r}'s chat template ({template.source}) "
                "writes no tool-call format we parse; set tool_parser in the config, or "
                "use tool_choice required or a named function",
                "tool_choice",
            )
        text, ids = self._chat_prompt(
            template, body, body.add_generation_prompt is not False, body.chat_template_kwargs
        )
        named = body.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
        free_text = body.response_format is None or body.response_format.type == "text"
        strict = mode == "auto" and free_text
        answers = ChatAnswers(
            functools.partial(answer_parser, template, mode, named, text),
            body.parallel_calls(),
            template.special_tokens(mode),
            template.strict_calls(body.tool_signatures()) if strict else None,
        )
        return [Prompt(ids)], answers

    async def _serve(
        self,
        body: Any,
        prepare: Callable[[AdapterInfo | None], tuple[list[Prompt], ChatAnswers | None]],
        chat: bool,
        start: float,
        caller: Caller,
        front: Any = streams,
    ) -> Any:
        """`prepare(adapter)`: the request's prompts, and for chat how its answers read;
        `front`: what shapes the answer (`response`) and its stream (`sse`): the chat and
        completions APIs' (router.streams) or the Responses API's."""
        n = body.n or 1
        wants_logprobs = body.num_logprobs() is not None
        output = RequestOutput(self.tokenizer, [], n, start)  # until the prompts are known
        logprobs = self.logprob_formatter if wants_logprobs else None
        # The replica enforces the deadline (and aborts the request); the ingress waits a
        # little longer, for requests that never reach a replica (queued at the handle).
        deadline = start + self.options.request_timeout_s
        backstop = deadline + DEADLINE_GRACE_S
        # "abort" unless set below: the task was cancelled, the client went away
        kind, model, outcome, streaming = "unknown", "unknown", "abort", False
        lease: Lease | None = None
        try:
            info = await self._resolve_info(body.model, caller, backstop)
            adapter = None if info is None else AdapterKey(info.name, info.version)
            kind, model = ("base" if adapter is None else "adapter"), body.model
            prompts, answers = prepare(info)
            # a parser whose markers are special tokens reads the text with them kept (and
            # without the EOS that ends it), unless the client said otherwise
            keep_special = body.skip_special_tokens is None and bool(
                answers and answers.special_tokens
            )
            hidden = frozenset(self.tokenizer.all_special_ids) if keep_special else frozenset()
            output = RequestOutput(
                self.tokenizer,
                prompts,
                n,
                start,
                TextOptions(
                    body.stop_strings(),
                    skip_special_tokens=not keep_special and body.skip_special_tokens is not False,
                    include_stop_str=bool(body.include_stop_str_in_output),
                    wants_prompt_logprobs=not chat and bool(body.echo) and wants_logprobs,
                    token_ids=bool(body.return_token_ids),
                    hidden_end_tokens=hidden,
                ),
            )
            messages = None if answers is None else answers.assemblers(len(output.choices))
            if any(not prompt.ids for prompt in prompts):
                raise BadRequestError("the prompt is empty", "prompt")
            # chat's default max_tokens is the rest of the context (None), as vLLM's
            default_max_tokens = None if chat else self.default_max_tokens
            sampling = _sampling(body, default_max_tokens, self.model_defaults)
            if answers is not None and answers.constraint is not None:
                sampling = sampling.model_copy(update={"structured_output": answers.constraint})
            charge = _token_charge(prompts, sampling, n, self.max_model_len)
            lease = await self.tenancy.admit(caller, charge)
            request_id = p.chat_completion_id() if chat else p.completion_id()
            # completions have no safety_identifier
            who = (body.user, getattr(body, "safety_identifier", None))
            log.debug("%s: model %s, user %r, safety_identifier %r", request_id, model, *who)
            # a batch of prompts: one replica request each (ids the replicas' logs tell
            # apart)
            ids = (
                [request_id]
                if len(prompts) == 1
                else [f"{request_id}-{i}" for i in range(len(prompts))]
            )
            budget = deadline - time.perf_counter()
            tenant = caller.tenant
            calls = [
                functools.partial(
                    self.replicas.generate.remote,
                    GenerateRequest(
                        prompt.ids,
                        sampling,
                        adapter,
                        rid,
                        timeout_s=budget,
                        tenant=None if tenant is None else tenant.name,
                        tenant_weight=1.0 if tenant is None else tenant.weight,
                        cache_salt=body.cache_salt,
                    ),
                )
                for prompt, rid in zip(prompts, ids)
            ]
            streams = Streams([calls[0](), *(own_request_id(call) for call in calls[1:])])
            firsts = await streams.first(backstop)
            if body.stream:
                chunks = front.sse(
                    streams,
                    firsts,
                    output,
                    (model, request_id),
                    messages,
                    (body.include_usage(), body.continuous_usage()),
                    logprobs,
                    functools.partial(self._record, kind, model, output=output, lease=lease),
                )
                streaming = True  # sse records the request when the stream ends
                return StreamingResponse(
                    chunks, media_type="text/event-stream", headers=lease.headers
                )
            for i, message in enumerate(firsts):
                output.add(i, message)
            async for i, message in streams.rest(output):
                output.add(i, message)
            outcome = output.finish_reason
            answer = front.response(messages, request_id, model, output, logprobs)
            if not lease.headers:
                return answer
            return Response(
                answer.model_dump_json(), media_type="application/json", headers=lease.headers
            )
        except Exception as e:
            outcome = str(getattr(e, "status", 500))
            if isinstance(e, APIError) and lease is not None and lease.headers:
                e.headers = {**(e.headers or {}), **lease.headers}
            raise
        finally:
            if not streaming:
                ended = self._record(kind, model, outcome, output, lease)
                if ended is not None:  # the usage endpoint counts it once this answers
                    with contextlib.suppress(Exception):
                        await ended

    def _record(
        self, kind: str, model: str, outcome: str, output: RequestOutput, lease: Lease | None
    ) -> Any:
        """Metrics of a request that ended; for a tenant's, the refund of the tokens it
        did not use and its usage (the ledger's answer, or None)."""
        elapsed = time.perf_counter() - output.start
        self.metrics.record(
            kind, model, outcome, output.ttft_s, elapsed, output.num_tokens, output.itl_s
        )
        if lease is None:
            return None
        return self.tenancy.finish(lease, model, output.usage())


# Ingress with the app's routes bound to the Serve replica's Ingress object; build_app makes
# it a deployment. Made at import, not in build_app: the replica unpickles the routes by
# reference to this module, and its import must make them the same class-based views.
ServedIngress = serve.ingress(app)(Ingress)
