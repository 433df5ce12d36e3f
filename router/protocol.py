"""The OpenAI HTTP API subset we serve, as pydantic models (vLLM-compatible field names).

Requests ignore unknown fields, because the openai SDK and other clients send extras, but
refuse known features we do not implement (n > 1, logprobs, echo, ...) with a message naming
the field, rather than silently answering something else. Sampling fields take their types
(bounds) and defaults from replica.wire.SamplingParams, which a request then builds directly.
Responses are shaped so that the official `openai` SDK parses them. Plain Python: nothing
here touches Ray or tensors.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from replica.wire import (
    MaxTokens,
    SamplingParams,
    Seed,
    Temperature,
    TokenId,
    TopK,
    TopP,
)

MAX_STOP_STRINGS = 4
LORA_NAME_RULE = "1-128 characters, each a letter, digit, '.', '_' or '-'"
_LORA_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
SSE_DONE = "data: [DONE]\n\n"

FinishReason = Literal["stop", "length"]


def _default(name: str) -> Any:
    """A sampling field's default: SamplingParams's, the one definition."""
    return SamplingParams.model_fields[name].default


def random_uuid() -> str:
    """32 hex characters: unique enough for request and response ids."""
    return uuid.uuid4().hex


def unix_time() -> int:
    """The `created` timestamp of OpenAI objects: whole seconds since the epoch."""
    return int(time.time())


def completion_id() -> str:
    return f"cmpl-{random_uuid()}"


def chat_completion_id() -> str:
    return f"chatcmpl-{random_uuid()}"


def sse_event(chunk: BaseModel) -> str:
    """One server-sent event carrying `chunk`; end the stream with SSE_DONE."""
    return f"data: {chunk.model_dump_json()}\n\n"


# ---------------------------------------------------------------------------------------
# requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = Field(False, description="Send a last chunk with token usage.")


class _SamplingRequest(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")
    # field -> the only values we accept; anything else is refused as "not supported"
    _ACCEPTED: ClassVar[Mapping[str, tuple[Any, ...]]] = {}

    model: str = Field(description="The base model's name or a loaded adapter's lora_name.")
    temperature: Temperature = Field(_default("temperature"), description="0 = greedy.")
    top_p: TopP = Field(_default("top_p"), description="Nucleus sampling mass.")
    top_k: TopK = Field(
        _default("top_k"), description="vLLM extension: keep the k best tokens; 0 = all."
    )
    seed: Seed | None = Field(None, description="Per-request seed for reproducible sampling.")
    stop: str | list[str] | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} strings that end the output (excluded)."
    )
    stop_token_ids: list[TokenId] | None = Field(
        None, description="vLLM extension: token ids that end the output."
    )
    ignore_eos: bool = Field(
        _default("ignore_eos"), description="vLLM extension: generate past EOS."
    )
    stream: bool = Field(False, description="Answer with server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream=true.")
    n: int = Field(1, description="Number of choices; only 1 is supported.")
    user: str | None = Field(None, description="End-user id, accepted and ignored.")

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_minus_one_means_all(cls, value: Any) -> Any:
        # vLLM and older clients spell "no top-k" as -1
        return 0 if value == -1 else value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported (one choice per request)")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream=true")
        return value

    @field_validator("*")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        accepted = cls._ACCEPTED.get(info.field_name or "")
        if accepted is not None and value not in accepted:
            raise ValueError(f"{info.field_name} is not supported")
        return value

    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def stop_strings(self) -> list[str]:
        """`stop` as a list, whether the client sent one string, a list or nothing."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (stream_options.include_usage)."""
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """What the replica samples with; `default_max_tokens` when the request sets none."""
        max_tokens = self.requested_max_tokens()
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions: one prompt, as text or as token ids."""

    _ACCEPTED = {"echo": (False,), "logprobs": (None,), "best_of": (None, 1), "suffix": (None,)}

    prompt: str | list[TokenId] = Field(description="One prompt: text or token ids.")
    max_tokens: MaxTokens | None = Field(
        _default("max_tokens"), description="null = up to the server's default."
    )
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        # the API allows a batch of prompts; we take a batch of one and refuse more
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) > 1:
                raise ValueError("only one prompt per request is supported")
            value = value[0]
        if isinstance(value, (str, list)) and not value:
            raise ValueError("prompt must not be empty")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    _ACCEPTED = {"logprobs": (False,), "top_logprobs": (None, 0)}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = Field(None, description="Deprecated by OpenAI; still sent.")
    max_completion_tokens: MaxTokens | None = Field(None, description="Wins over max_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = None

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as the plain dicts a Hugging Face chat template expects."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def _check_lora_name(name: str) -> str:
    if not _LORA_NAME.fullmatch(name):
        raise ValueError(f"lora_name must be {LORA_NAME_RULE}; got {name!r}")
    return name


LoraName = Annotated[str, AfterValidator(_check_lora_name)]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's endpoint)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: LoraName = Field(description="The name clients then pass as `model`.")
    lora_path: str = Field(min_length=1, description="A PEFT adapter directory.")


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's endpoint)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: LoraName


def format_validation_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    """One line per error of pydantic's / FastAPI's `.errors()`, each naming its field."""
    lines = []
    for err in errors:
        loc = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(lines)


# ---------------------------------------------------------------------------------------
# responses


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason
    # vLLM extension: the stop string or stop token id that ended the output, if any
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(BaseModel):
    """One SSE chunk; every chunk of a stream carries the same id and created."""

    id: str = Field(default_factory=completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=chat_completion_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """The first chunk of a chat stream carries role="assistant", later ones only content."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str = Field(default_factory=chat_completion_id)
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """An entry of GET /v1/models: the base model (root) or an adapter (parent = base)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_time)
    owned_by: str = "lorafleet"
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body; the openai SDK reads message, type, param and code from it."""

    error: ErrorInfo


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


def error_body(
    status: int, message: str, type_: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The JSON body of an error answer; `type_` defaults from the HTTP status."""
    if type_ is None:
        default = "invalid_request_error" if status < 500 else "internal_error"
        type_ = _ERROR_TYPES.get(status, default)
    info = ErrorInfo(message=message, type=type_, param=param, code=status)
    return ErrorResponse(error=info).model_dump()
