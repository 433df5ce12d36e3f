"""The HTTP face: an OpenAI-compatible FastAPI ingress deployment.

Validates bodies, resolves `model` to the base model or a registered adapter,
tokenizes (chat template for chat), calls a LoRAReplica through its handle (the
request router picks which) and turns the token stream into text: incremental
detokenization, stop strings, SSE chunks. No tensors here.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hmac
import inspect
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from replica.wire import AdapterKey, GenerateRequest, Reply
from router import extra_protocol as xp
from router import protocol as p
from router.choices import Delta, LogprobFormatter, Prompt, RequestOutput, TextOptions
from router.errors import (
    APIError,
    BadRequestError,
    GatewayTimeoutError,
    NotFoundError,
    ServiceUnavailableError,
    TooManyRequestsError,
    UnauthorizedError,
)
from router.metrics import PROMETHEUS_TEXT, IngressMetrics, export_urls, scrape
from router.model_defaults import sampling_defaults
from router.options import IngressOptions

log = logging.getLogger(__name__)

app = FastAPI(title="lorafleet", description="Multi-LoRA serving, OpenAI-compatible API.")


def _printable(text: str) -> str:
    """`text` without lone surrogates (written as \\udXXX): error messages may quote the
    client's input, and a response body must encode as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """An OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
    body = p.error_body(status, _printable(message), param=param and _printable(param))
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, getattr(e, "param", None), e.headers)


@app.exception_handler(RequestValidationError)
async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
    errors = [_unicode_error(err) for err in e.errors()]
    if errors and errors[0].get("type") == "json_invalid":
        return error_response(400, _json_error(errors[0], e.body))
    loc = errors[0].get("loc", ()) if errors else ()
    param = ".".join(str(part) for part in loc if part != "body") or None
    return error_response(400, p.format_validation_errors(errors), param)


def _json_error(error: dict[str, Any], document: Any) -> str:
    """A body that is not JSON: the parser's message and where, as line and column (FastAPI
    reports the character offset in `loc`, where a field name would be: not a param)."""
    reason = (error.get("ctx") or {}).get("error") or "not valid JSON"
    loc = error.get("loc", ())
    pos = loc[-1] if loc and isinstance(loc[-1], int) else None
    if pos is None or not isinstance(document, str):
        return f"Invalid JSON body: {reason}"
    line = document.count("\n", 0, pos) + 1
    column = pos - document.rfind("\n", 0, pos)  # 1-based, as json's own messages count
    return f"Invalid JSON body: {reason} (line {line} column {column})"


def _unicode_error(error: dict[str, Any]) -> dict[str, Any]:
    """pydantic's error for a lone surrogate where it wants a str (a key, in practice: it
    takes such values) says "unable to parse raw data": say which string it was."""
    if error.get("type") != "string_unicode":
        return error
    quoted = ascii(error.get("input"))  # \\udXXX, not the surrogate itself
    return {**error, "msg": f"invalid Unicode: a lone surrogate in {quoted}"}


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (no route, wrong method), which FastAPI would answer with
    {"detail": ...}."""
    method, path = request.method, request.url.path
    if e.status_code == 404:
        message = f"no such endpoint: {method} {path}"
    elif e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "")
        message = f"method {method} is not allowed on {path}; allowed: {allowed}"
    else:
        message = str(e.detail)
    return error_response(e.status_code, message, headers=e.headers)


class CatchAll:
    """Any exception that escapes a route becomes a 500 with an OpenAI error body (no
    traceback: that goes to the log), not Starlette's plain-text "Internal Server Error".
    A pure ASGI middleware, not an exception handler for Exception: Starlette re-raises
    after such a handler, and Serve would then report the error its own way."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = ended = False

        async def tracked(message: Message) -> None:
            nonlocal started, ended
            started = started or message["type"] == "http.response.start"
            ended = ended or (
                message["type"] == "http.response.body" and not message.get("more_body")
            )
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            error_id = p.random_uuid()[:12]
            log.exception("internal error %s on %s %s", error_id, scope["method"], scope["path"])
            if not started:
                message = f"internal server error (id {error_id}); the server log has details"
                await error_response(500, message)(scope, receive, send)
            elif not ended:  # the status line is out: end the body, the client sees it cut
                await send({"type": "http.response.body", "body": b"", "more_body": False})


class JSONBodies:
    """Every body this API takes is JSON: a POST whose Content-Type is missing, or is what
    `curl -d` sends by default (application/x-www-form-urlencoded) or text/plain, is read as
    JSON, not refused as "Input should be a valid dictionary"."""

    AS_JSON = (b"", b"application/x-www-form-urlencoded", b"text/plain")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            given = [v for k, v in scope["headers"] if k == b"content-type"]
            mime = given[0].split(b";")[0].strip().lower() if given else b""
            if mime in self.AS_JSON:
                headers.append((b"content-type", b"application/json"))
                scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)


app.add_middleware(CatchAll)
app.add_middleware(JSONBodies)


# The Authorization header, for the endpoints that may require an API key. (A default value,
# not an annotation: Serve's class-based views drop `request: Request` parameters.)
AUTHORIZATION = Header(None, include_in_schema=False)
DEADLINE_GRACE_S = 2.0  # the ingress's own deadline trails the replica's by this much
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


async def _next(stream: Any, deadline: float) -> Reply:
    """The stream's next message, or GatewayTimeoutError at the request's deadline."""
    try:
        return await asyncio.wait_for(stream.__anext__(), deadline - time.perf_counter())
    except asyncio.TimeoutError:
        raise GatewayTimeoutError("the request did not finish within its time limit") from None


async def _first_message(stream: Any, deadline: float) -> Reply:
    try:
        return await _next(stream, deadline)
    except StopAsyncIteration:
        raise ServiceUnavailableError("the replica ended the request without a reply") from None
    except APIError:
        raise
    except BackPressureError:  # Serve's queue for the replicas is full (max_queued_requests)
        raise TooManyRequestsError("the server is at capacity; retry later") from None
    except Exception as e:  # a replica that died or could not be reached
        raise ServiceUnavailableError(f"no replica could serve the request: {e}") from None


def _own_request_id(call: Callable[[], Any]) -> Any:
    """Make a handle call under a Serve internal request id of its own. Serve's request
    router indexes requests waiting for a replica by that id, which a call inherits from
    the HTTP request's context: two calls of one request (a batch of prompts) waiting at
    once collide there and one never reaches a replica (Ray 2.5x). Our own give-up
    cancels these calls; Serve's recursive cancellation tracks only the first."""

    def run() -> Any:
        serve_context._set_request_context(_internal_request_id=p.random_uuid())
        return call()

    return contextvars.copy_context().run(run)


class _Streams:
    """One HTTP request's GenerateRequests at the replicas: one per prompt, each a stream
    of Replies for its n choices. Whoever stops early (a stop string, an error, the
    deadline, a client gone) cancels the replica work still going, freeing its KV and slot."""

    def __init__(
        self, calls: list[Any], request_ids: list[str], n: int, give_up: Callable[[Any, str], None]
    ) -> None:
        self.calls, self.request_ids, self.n = calls, request_ids, n
        self._give_up = give_up
        self._ended: list[set[int]] = [set() for _ in calls]  # choices the replica finished

    async def first(self, deadline: float) -> list[Reply]:
        """Each stream's first message; a refusal, an error or a cancellation gives them
        all up."""
        try:
            firsts = await asyncio.gather(*(_first_message(c, deadline) for c in self.calls))
        except BaseException:  # an error, a timeout, the client gone: free their places
            self.give_up()
            raise
        refused = next((m for m in firsts if m.refused), None)
        if refused is not None:
            self.give_up()
            raise _status_error(refused.status, refused.error)
        for i, message in enumerate(firsts):
            self._seen(i, message)
        return firsts

    async def rest(
        self, output: RequestOutput, deadline: float
    ) -> AsyncIterator[tuple[int, Reply]]:
        """(prompt, message) as messages arrive, until every choice of `output` has
        finished; the caller adds each to `output` before asking for the next."""
        pending: dict[asyncio.Future[Reply], int] = {}

        def want(i: int) -> None:
            if not output.prompt_done(i):
                pending[asyncio.ensure_future(self._next(i, deadline))] = i
            else:  # its choices have what they need (a stop string may end one early)
                self.give_up(i)

        for i in range(len(self.calls)):
            want(i)
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    message = task.result()
                    self._seen(i, message)
                    yield i, message
                    want(i)
        finally:
            for task in pending:
                task.cancel()
            self.give_up()

    def give_up(self, only: int | None = None) -> None:
        """Cancel every stream (or stream `only`) whose replica work is not over."""
        for i, call in enumerate(self.calls):
            if only in (None, i) and len(self._ended[i]) < self.n:
                self._ended[i] = set(range(self.n))
                self._give_up(call, self.request_ids[i])

    def _seen(self, i: int, message: Reply) -> None:
        if message.finished:
            self._ended[i].add(message.index)

    async def _next(self, i: int, deadline: float) -> Reply:
        try:
            return await _next(self.calls[i], deadline)
        except StopAsyncIteration:
            raise ServiceUnavailableError("the replica ended the stream early") from None
        except APIError:
            raise
        except Exception as e:
            raise ServiceUnavailableError(f"the replica failed mid-request: {e}") from None


def _status_error(status: int, message: str) -> APIError:
    kinds = {400: BadRequestError, 404: NotFoundError}
    error = kinds.get(status, APIError)(message)
    error.status = status
    return error


def _response(
    chat: bool,
    request_id: str,
    model: str,
    output: RequestOutput,
    logprobs: LogprobFormatter | None,
) -> Any:
    """The whole answer: a choice per prompt and n, with logprobs and token ids when asked."""
    ids = output.options.token_ids
    choices = []
    for c in output.choices:
        choice: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if ids:
            choice["token_ids"] = c.token_ids
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
            if logprobs is not None:
                choice["logprobs"] = logprobs.chat(c.logprobs)
        else:
            choice["text"] = c.text
            if logprobs is not None:
                choice["logprobs"] = logprobs.completion(c.logprobs, c.first_token)
            if ids:
                choice["prompt_token_ids"] = c.prompt_ids
        choices.append(choice)
    usage = output.usage()
    if chat:
        prompt_ids = output.choices[0].prompt_ids if ids else None
        return p.ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage, prompt_token_ids=prompt_ids
        )
    return p.CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)


def _refuse_invalid_unicode(body: BaseModel) -> None:
    """A lone surrogate anywhere in the body: 400 naming the field (the tokenizer, and any
    UTF-8 encoder, would fail on it)."""
    if found := xp.find_invalid_unicode(body):
        param, message = found
        raise BadRequestError(message, param)


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


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(
        self,
        replicas: Any,
        store: Any,
        model_dir: str,
        served_model_name: str,
        options: IngressOptions | None = None,
    ) -> None:
        """`replicas` and `store` are DeploymentHandles (LoRAReplica, AdapterStore)."""
        self.replicas = replicas.options(stream=True)
        self.store = store
        self.model_dir = model_dir
        self.model_name = served_model_name
        self.options = options = options or IngressOptions()
        self.default_max_tokens = options.default_max_tokens
        self.model_defaults = sampling_defaults(model_dir)  # generation_config.json
        key = options.api_key or os.environ.get(options.api_key_env) or None
        self._api_key = None if key is None else key.encode()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.max_model_len = _context_length(model_dir, self.tokenizer)
        self.logprob_formatter = LogprobFormatter(self.tokenizer)
        self.created = int(time.time())
        self.metrics = IngressMetrics()
        self._models_body: tuple[Any, bytes] | None = None  # (store's listing tag, body)

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

    def _authorize(self, authorization: str | None, admin: bool) -> None:
        """Bearer-token check, constant-time; admin endpoints always, the rest if asked."""
        if self._api_key is None or not (admin or self.options.api_key_for_inference):
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self._api_key):
            raise UnauthorizedError("a valid API key is required (Authorization: Bearer KEY)")

    @app.get("/v1/models", response_model=p.ModelList)
    async def models(self, authorization: str | None = AUTHORIZATION) -> Response:
        """The base model and every adapter. The body is rendered once per registry
        change (the store's listing tag) and kept: with thousands of adapters a GET
        costs one small store call, not a list pickled, validated and rendered."""
        self._authorize(authorization, admin=False)
        known = self._models_body[0] if self._models_body is not None else None
        tag, infos = await self.store.listing.remote(known)
        if infos is not None or self._models_body is None:
            cards = [self._adapter_card(a) for a in infos or ()]
            body = p.ModelList(data=[self._base_card(), *cards]).model_dump_json()
            self._models_body = (tag, body.encode())
        return Response(self._models_body[1], media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, authorization: str | None = AUTHORIZATION) -> p.ModelCard:
        """One ModelCard: the base model's or an adapter's (ids may hold slashes)."""
        self._authorize(authorization, admin=False)
        if model_id == self.model_name:
            return self._base_card()
        return self._adapter_card(await self._adapter_info(model_id))

    def _base_card(self) -> p.ModelCard:
        return p.ModelCard(id=self.model_name, created=self.created, root=self.model_dir)

    def _adapter_card(self, info: Any) -> p.ModelCard:
        """An AdapterInfo as a ModelCard."""
        return p.ModelCard(
            id=info.name, created=info.created, root=info.path, parent=self.model_name
        )

    @app.get("/v1/lorafleet/stats")
    async def stats(self, authorization: str | None = AUTHORIZATION) -> dict[str, Any]:
        """Per-replica counters (adapter loads, residency, queue) and the store's own; they
        name the adapters, so they need the key where /v1/models does."""
        self._authorize(authorization, admin=False)
        return {
            "replicas": await self.store.replica_stats.remote(),
            "store": await self.store.stats.remote(),
        }

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
        self._authorize(authorization, admin=False)
        _refuse_invalid_unicode(body)
        if body.model is not None:
            await self._resolve(body.model)
        if body.messages is not None:
            chat = p.ChatCompletionRequest.model_construct(messages=body.messages)
            ids = self._chat_prompt_ids(
                chat.chat_messages(),
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
        self._authorize(authorization, admin=False)
        _refuse_invalid_unicode(body)
        if body.model is not None:
            await self._resolve(body.model)
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

    def _chat_prompt_ids(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
        add_special_tokens: bool = False,  # the template writes BOS itself
    ) -> list[int]:
        kwargs = dict(template_kwargs or {})
        if reserved := sorted(_TEMPLATE_PARAMETERS.intersection(kwargs)):
            raise BadRequestError(
                f"chat_template_kwargs: {', '.join(reserved)} cannot be set here",
                "chat_template_kwargs",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as e:  # a template may reject a conversation (roles, order)
            raise BadRequestError(f"chat template: {e}", "messages") from None
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    # -- adapters (vLLM's endpoints) -----------------------------------------------------------

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(
        self, body: p.LoadLoRAAdapterRequest, authorization: str | None = AUTHORIZATION
    ) -> dict[str, Any]:
        self._authorize(authorization, admin=True)
        _refuse_invalid_unicode(body)
        if body.lora_name == self.model_name:
            raise BadRequestError(f"{body.lora_name!r} is the base model's name", "lora_name")
        info = await self.store.register.remote(body.lora_name, body.lora_path, body.load_inplace)
        return {"status": "ok", "lora_name": info.name, "version": info.version}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(
        self, body: p.UnloadLoRAAdapterRequest, authorization: str | None = AUTHORIZATION
    ) -> dict[str, Any]:
        self._authorize(authorization, admin=True)
        _refuse_invalid_unicode(body)
        info = await self.store.unregister.remote(body.lora_name)
        return {"status": "ok", "lora_name": info.name}

    # -- generation ----------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(
        self, body: p.CompletionRequest, authorization: str | None = AUTHORIZATION
    ) -> Any:
        start = time.perf_counter()
        self._authorize(authorization, admin=False)
        _refuse_invalid_unicode(body)
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
        return await self._serve(body, prompts, False, start)

    @app.post("/v1/chat/completions")
    async def chat_completions(
        self, body: p.ChatCompletionRequest, authorization: str | None = AUTHORIZATION
    ) -> Any:
        start = time.perf_counter()
        self._authorize(authorization, admin=False)
        _refuse_invalid_unicode(body)
        prompt_ids = self._chat_prompt_ids(
            body.chat_messages(), body.add_generation_prompt is not False, body.chat_template_kwargs
        )
        return await self._serve(body, [Prompt(prompt_ids)], True, start)

    async def _serve(self, body: Any, prompts: list[Prompt], chat: bool, start: float) -> Any:
        n = body.n or 1
        wants_logprobs = body.num_logprobs() is not None
        output = RequestOutput(
            self.tokenizer,
            prompts,
            n,
            start,
            TextOptions(
                body.stop_strings(),
                skip_special_tokens=body.skip_special_tokens is not False,
                include_stop_str=bool(body.include_stop_str_in_output),
                wants_prompt_logprobs=not chat and bool(body.echo) and wants_logprobs,
                token_ids=bool(body.return_token_ids),
            ),
        )
        logprobs = self.logprob_formatter if wants_logprobs else None
        # The replica enforces the deadline (and aborts the request); the ingress waits a
        # little longer, for requests that never reach a replica (queued at the handle).
        deadline = start + self.options.request_timeout_s
        backstop = deadline + DEADLINE_GRACE_S
        # "abort" unless set below: the task was cancelled, the client went away
        kind, model, outcome, streaming = "unknown", "unknown", "abort", False
        try:
            adapter = await self._resolve(body.model, backstop)
            kind, model = ("base" if adapter is None else "adapter"), body.model
            if any(not prompt.ids for prompt in prompts):
                raise BadRequestError("the prompt is empty", "prompt")
            # chat's default max_tokens is the rest of the context (None), as vLLM's
            default_max_tokens = None if chat else self.default_max_tokens
            sampling = _sampling(body, default_max_tokens, self.model_defaults)
            request_id = p.chat_completion_id() if chat else p.completion_id()
            log.debug("%s: model %s, user %r", request_id, model, body.user)
            # a batch of prompts: one replica request each (ids that the store's cancel
            # list and the replicas' logs tell apart)
            ids = (
                [request_id]
                if len(prompts) == 1
                else [f"{request_id}-{i}" for i in range(len(prompts))]
            )
            budget = deadline - time.perf_counter()
            calls = [
                functools.partial(
                    self.replicas.generate.remote,
                    GenerateRequest(adapter, prompt.ids, sampling, rid, budget),
                )
                for prompt, rid in zip(prompts, ids)
            ]
            streams = _Streams(
                [calls[0](), *(_own_request_id(call) for call in calls[1:])],
                ids,
                n,
                self._give_up,
            )
            firsts = await streams.first(backstop)
            if body.stream:
                chunks = self._sse(
                    streams,
                    firsts,
                    output,
                    (model, kind, request_id, backstop),
                    chat,
                    (body.include_usage(), body.continuous_usage()),
                    logprobs,
                )
                streaming = True  # _sse records the request when the stream ends
                return StreamingResponse(chunks, media_type="text/event-stream")
            for i, message in enumerate(firsts):
                output.add(i, message)
            async for i, message in streams.rest(output, backstop):
                output.add(i, message)
            outcome = output.finish_reason
            return _response(chat, request_id, model, output, logprobs)
        except Exception as e:
            outcome = str(getattr(e, "status", 500))
            raise
        finally:
            if not streaming:
                self._record(kind, model, outcome, output)

    def _give_up(self, stream: Any, request_id: str) -> None:
        """Stop a request we no longer want: Serve's cancel, and the store's cancel list,
        which replicas read every stats period (Serve's cancel does not always reach)."""
        # A call that already failed (refused, replica gone) re-raises that error from
        # cancel(): then there is nothing to cancel.
        with contextlib.suppress(Exception):
            stream.cancel()
        self.store.cancel_requests.remote([request_id])

    def _record(self, kind: str, model: str, outcome: str, output: RequestOutput) -> None:
        elapsed = time.perf_counter() - output.start
        self.metrics.record(
            kind, model, outcome, output.ttft_s, elapsed, output.num_tokens, output.itl_s
        )

    async def _resolve(self, model: str, deadline: float | None = None) -> AdapterKey | None:
        """The adapter version `model` names; None for the base model."""
        if model == self.model_name:
            return None
        info = await self._adapter_info(model, deadline)
        return AdapterKey(info.name, info.version)

    async def _adapter_info(self, model: str, deadline: float | None = None) -> Any:
        """The store's AdapterInfo of `model`. The store may have to find and load it first
        (adapter_resolvers): that wait ends at `deadline` (perf_counter; default: the
        request time limit from now)."""
        if deadline is None:
            deadline = time.perf_counter() + self.options.request_timeout_s
        try:
            return await asyncio.wait_for(
                self.store.resolve.remote(model), max(0.0, deadline - time.perf_counter())
            )
        except NotFoundError as e:
            # the store's reason, not the whole list: with thousands of adapters every 404
            # would carry it
            raise NotFoundError(
                f"model {model!r} does not exist ({e.message}); GET /v1/models lists the "
                "available ones",
                "model",
            ) from None
        except asyncio.TimeoutError:
            raise GatewayTimeoutError(
                f"model {model!r}: finding and loading the adapter took longer than the "
                "request's time limit"
            ) from None

    async def _sse(
        self,
        streams: _Streams,
        firsts: list[Reply],
        output: RequestOutput,
        request: tuple[str, str, str, float],
        chat: bool,
        usage: tuple[bool, bool],
        logprobs: LogprobFormatter | None,
    ) -> AsyncIterator[str]:
        model, kind, request_id, deadline = request
        include_usage, continuous_usage = usage
        created = int(time.time())
        chunk = p.ChatCompletionStreamResponse if chat else p.CompletionStreamResponse
        offsets = [0] * len(output.choices)  # completions' text_offset, per choice
        ids = output.options.token_ids
        prompt_ids_sent = [False] * len(output.choices)  # return_token_ids: with the first

        def event(delta: Delta, role: bool = False) -> str:
            choice: dict[str, Any] = {"index": delta.index, "finish_reason": delta.finish_reason}
            if delta.finish_reason is not None:  # the last chunk of the choice says what ended it
                choice["stop_reason"] = delta.stop_reason
            extra: dict[str, Any] = {}
            if ids and not role:
                choice["token_ids"] = delta.token_ids
            if ids and not prompt_ids_sent[delta.index]:
                prompt_ids_sent[delta.index] = True
                prompt_ids = output.choices[delta.index].prompt_ids
                if not chat:
                    choice["prompt_token_ids"] = prompt_ids
                elif delta.index == 0:  # chat: once, on the response (one prompt)
                    extra["prompt_token_ids"] = prompt_ids
            if chat:
                choice["delta"] = (
                    {"role": "assistant", "content": ""} if role else {"content": delta.text}
                )
                if logprobs is not None and not role:
                    choice["logprobs"] = logprobs.chat(delta.logprobs)
            else:
                choice["text"] = delta.text
                if logprobs is not None:
                    lp = logprobs.completion(
                        delta.logprobs, delta.first_token, offsets[delta.index]
                    )
                    offsets[delta.index] += sum(map(len, lp.tokens))
                    choice["logprobs"] = lp
            so_far = output.usage() if continuous_usage else None
            return p.sse_event(
                chunk(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[choice],
                    usage=so_far,
                    **extra,
                )
            )

        async def deltas() -> AsyncIterator[Delta]:
            for i, message in enumerate(firsts):
                if (delta := output.add(i, message)) is not None:
                    yield delta
            async for i, message in streams.rest(output, deadline):
                if (delta := output.add(i, message)) is not None:
                    yield delta

        outcome = "abort"  # unless the stream ends below: the client went away
        try:
            if chat:
                for choice in output.choices:
                    yield event(Delta(choice.index, ""), role=True)
            async for delta in deltas():
                if delta.text or delta.finish_reason or delta.logprobs or (ids and delta.token_ids):
                    yield event(delta)
            outcome = output.finish_reason
            if include_usage:
                yield p.sse_event(
                    chunk(
                        id=request_id,
                        created=created,
                        model=model,
                        choices=[],
                        usage=output.usage(),
                    )
                )
        except Exception as e:  # after the 200 header only an error event can tell the client
            if isinstance(e, APIError):
                status, message = e.status, e.message
            else:  # a bug: logged with its traceback, the client gets no traceback
                log.exception("internal error in the stream of %s", request_id)
                status, message = 500, "internal server error; the server log has details"
            outcome = str(status)
            yield f"data: {json.dumps(p.error_body(status, _printable(message)))}\n\n"
        finally:
            # the client gone mid-stream closes this generator, not the inner ones (their
            # own finally would cancel only when garbage collected): cancel now
            streams.give_up()
            self._record(kind, model, outcome, output)
        yield p.SSE_DONE
