"""The HTTP face: an OpenAI-compatible FastAPI ingress deployment.

Validates bodies, resolves `model` to the base model or a registered adapter,
tokenizes (chat template for chat), calls a LoRAReplica through its handle (the
request router picks which) and turns the token stream into text: incremental
detokenization, stop strings, SSE chunks. No tensors here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from transformers import AutoTokenizer

from replica.wire import AdapterKey, GenerateRequest, Reply
from router import protocol as p
from router.detokenize import IncrementalDetokenizer, StopStringMatcher
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
from router.options import IngressOptions

app = FastAPI(title="lorafleet", description="Multi-LoRA serving, OpenAI-compatible API.")


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return JSONResponse(p.error_body(e.status, e.message), status_code=e.status, headers=e.headers)


@app.exception_handler(RequestValidationError)
async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
    return JSONResponse(p.error_body(400, p.format_validation_errors(e.errors())), status_code=400)


# The Authorization header, for the endpoints that may require an API key. (A default value,
# not an annotation: Serve's class-based views drop `request: Request` parameters.)
AUTHORIZATION = Header(None, include_in_schema=False)
DEADLINE_GRACE_S = 2.0  # the ingress's own deadline trails the replica's by this much

# Everything the Ingress methods use is defined above the class: serve.ingress copies the
# methods with the module globals of that moment.


class _Output:
    """One request's text so far: detokenized incrementally, cut at a stop string."""

    def __init__(self, tokenizer: Any, stop: list[str], start: float) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = StopStringMatcher(stop)
        self.num_tokens = 0
        self.num_prompt_tokens = 0
        self.finish_reason: str | None = None
        self.start = start  # time.perf_counter() at the request's arrival
        self.ttft_s: float | None = None
        self.itl_s: list[float] = []  # one per token after the first
        self._last_reply = start

    def add(self, message: Reply) -> str:
        """New text from one replica message; sets finish_reason when the request ends."""
        if message.error and message.finish_reason == "error":
            status = message.status or 503
            if status == 504:  # the replica enforced the request's deadline
                raise GatewayTimeoutError(message.error)
            raise ServiceUnavailableError(f"generation failed: {message.error}")
        self.num_prompt_tokens = message.num_prompt_tokens or self.num_prompt_tokens
        if n := len(message.token_ids):
            # A reply carries the tokens made since the last one: they share its gap (the
            # first reply's extra tokens came with the first token: gap 0).
            now = time.perf_counter()
            if self.ttft_s is None:
                self.ttft_s = now - self.start
                self.itl_s += [0.0] * (n - 1)
            else:
                self.itl_s += [(now - self._last_reply) / n] * n
            self._last_reply = now
        text = ""
        for token in message.token_ids:
            self.num_tokens += 1
            delta, stopped = self.stop.feed(self.detok.add(token))
            text += delta
            if stopped:
                self.finish_reason = "stop"
                return text
        if message.finished:
            if message.finish_reason not in ("stop", "length"):
                raise ServiceUnavailableError(f"request ended: {message.finish_reason}")
            delta, stopped = self.stop.feed(self.detok.flush())
            text += delta if stopped else delta + self.stop.flush()
            self.finish_reason = "stop" if stopped else message.finish_reason
        return text

    def usage(self) -> p.UsageInfo:
        return p.UsageInfo.of(self.num_prompt_tokens, self.num_tokens)


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


async def _until_done(
    stream: Any, output: _Output, deadline: float, give_up: Callable[[], None]
) -> AsyncIterator[Reply]:
    """The replica's messages until the request finishes. Whoever stops early (a stop
    string, an error, the deadline, a client gone) cancels the replica's work, freeing its
    KV and slot."""
    replica_done = False
    try:
        while output.finish_reason is None:
            try:
                message = await _next(stream, deadline)
            except StopAsyncIteration:
                raise ServiceUnavailableError("the replica ended the stream early") from None
            except APIError:
                raise
            except Exception as e:
                raise ServiceUnavailableError(f"the replica failed mid-request: {e}") from None
            replica_done = message.finished
            yield message
    finally:
        if not replica_done:
            give_up()


def _status_error(status: int, message: str) -> APIError:
    kinds = {400: BadRequestError, 404: NotFoundError}
    error = kinds.get(status, APIError)(message)
    error.status = status
    return error


def _response(chat: bool, request_id: str, model: str, text: str, output: _Output) -> Any:
    if chat:
        return p.ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=[
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": output.finish_reason,
                }
            ],
            usage=output.usage(),
        )
    return p.CompletionResponse(
        id=request_id,
        model=model,
        choices=[{"index": 0, "text": text, "finish_reason": output.finish_reason}],
        usage=output.usage(),
    )


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
        key = options.api_key or os.environ.get(options.api_key_env) or None
        self._api_key = None if key is None else key.encode()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.created = int(time.time())
        self.metrics = IngressMetrics()

    # -- service -------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    def _authorize(self, authorization: str | None, admin: bool) -> None:
        """Bearer-token check, constant-time; admin endpoints always, the rest if asked."""
        if self._api_key is None or not (admin or self.options.api_key_for_inference):
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self._api_key):
            raise UnauthorizedError("a valid API key is required (Authorization: Bearer KEY)")

    @app.get("/v1/models")
    async def models(self, authorization: str | None = AUTHORIZATION) -> p.ModelList:
        self._authorize(authorization, admin=False)
        base = p.ModelCard(id=self.model_name, created=self.created, root=self.model_dir)
        cards = [
            p.ModelCard(id=a.name, created=a.created, root=a.path, parent=self.model_name)
            for a in await self.store.list.remote()
        ]
        return p.ModelList(data=[base, *cards])

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

    # -- adapters (vLLM's endpoints) -----------------------------------------------------------

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(
        self, body: p.LoadLoRAAdapterRequest, authorization: str | None = AUTHORIZATION
    ) -> dict[str, Any]:
        self._authorize(authorization, admin=True)
        if body.lora_name == self.model_name:
            raise BadRequestError(f"{body.lora_name!r} is the base model's name")
        info = await self.store.register.remote(body.lora_name, body.lora_path)
        return {"status": "ok", "lora_name": info.name, "version": info.version}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(
        self, body: p.UnloadLoRAAdapterRequest, authorization: str | None = AUTHORIZATION
    ) -> dict[str, Any]:
        self._authorize(authorization, admin=True)
        info = await self.store.unregister.remote(body.lora_name)
        return {"status": "ok", "lora_name": info.name}

    # -- generation ----------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(
        self, body: p.CompletionRequest, authorization: str | None = AUTHORIZATION
    ) -> Any:
        start = time.perf_counter()
        self._authorize(authorization, admin=False)
        if isinstance(body.prompt, str):
            prompt_ids = self.tokenizer(body.prompt)["input_ids"]
        else:
            prompt_ids = list(body.prompt)
        return await self._serve(body, prompt_ids, False, start)

    @app.post("/v1/chat/completions")
    async def chat_completions(
        self, body: p.ChatCompletionRequest, authorization: str | None = AUTHORIZATION
    ) -> Any:
        start = time.perf_counter()
        self._authorize(authorization, admin=False)
        messages = body.chat_messages()
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # a template may reject a conversation (roles, order)
            raise BadRequestError(f"chat template: {e}") from None
        prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return await self._serve(body, prompt_ids, True, start)

    async def _serve(self, body: Any, prompt_ids: list[int], chat: bool, start: float) -> Any:
        output = _Output(self.tokenizer, body.stop_strings(), start)
        # The replica enforces the deadline (and aborts the request); the ingress waits a
        # little longer, for requests that never reach a replica (queued at the handle).
        deadline = start + self.options.request_timeout_s
        backstop = deadline + DEADLINE_GRACE_S
        # "abort" unless set below: the task was cancelled, the client went away
        kind, model, outcome, streaming = "unknown", "unknown", "abort", False
        try:
            adapter = await self._resolve(body.model)
            kind, model = ("base" if adapter is None else "adapter"), body.model
            if not prompt_ids:
                raise BadRequestError("the prompt is empty")
            request_id = p.chat_completion_id() if chat else p.completion_id()
            request = GenerateRequest(
                adapter,
                prompt_ids,
                body.sampling_params(self.default_max_tokens),
                request_id,
                deadline - time.perf_counter(),
            )
            stream = self.replicas.generate.remote(request)
            give_up = functools.partial(self._give_up, stream, request_id)
            try:
                first = await _first_message(stream, backstop)
            except TooManyRequestsError:  # refused at the handle: it never reached a replica
                raise
            except BaseException:  # a timeout, or the client gone (cancelled): free its place
                give_up()
                raise
            if first.refused:
                raise _status_error(first.status, first.error)
            if body.stream:
                chunks = self._sse(
                    stream,
                    first,
                    output,
                    (model, kind, request_id, backstop, give_up),
                    chat,
                    body.include_usage(),
                )
                streaming = True  # _sse records the request when the stream ends
                return StreamingResponse(chunks, media_type="text/event-stream")
            text = output.add(first)
            async for message in _until_done(stream, output, backstop, give_up):
                text += output.add(message)
            outcome = output.finish_reason
            return _response(chat, request_id, model, text, output)
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

    def _record(self, kind: str, model: str, outcome: str, output: _Output) -> None:
        elapsed = time.perf_counter() - output.start
        self.metrics.record(
            kind, model, outcome, output.ttft_s, elapsed, output.num_tokens, output.itl_s
        )

    async def _resolve(self, model: str) -> AdapterKey | None:
        """The adapter version `model` names; None for the base model."""
        if model == self.model_name:
            return None
        try:
            info = await self.store.resolve.remote(model)
        except NotFoundError:
            names = [self.model_name, *(a.name for a in await self.store.list.remote())]
            raise NotFoundError(
                f"model {model!r} does not exist; available models: {names}"
            ) from None
        return AdapterKey(info.name, info.version)

    async def _sse(
        self,
        stream: Any,
        first: Reply,
        output: _Output,
        request: tuple[str, str, str, float, Callable[[], None]],
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        model, kind, request_id, deadline, give_up = request
        created = int(time.time())
        chunk = p.ChatCompletionStreamResponse if chat else p.CompletionStreamResponse

        def event(text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            return p.sse_event(chunk(id=request_id, created=created, model=model, choices=[choice]))

        outcome = "abort"  # unless the stream ends below: the client went away
        try:
            if chat:
                yield event("", None, role=True)
            text = output.add(first)
            if text or output.finish_reason:
                yield event(text, output.finish_reason)
            async for message in _until_done(stream, output, deadline, give_up):
                text = output.add(message)
                if text or output.finish_reason:
                    yield event(text, output.finish_reason)
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
        except APIError as e:  # after the 200 header only an error event can tell the client
            outcome = str(e.status)
            yield f"data: {json.dumps(p.error_body(e.status, e.message))}\n\n"
        finally:
            self._record(kind, model, outcome, output)
        yield p.SSE_DONE
