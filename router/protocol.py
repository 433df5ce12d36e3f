"""The OpenAI HTTP API subset we serve, as pydantic models (vLLM-compatible field names).

Requests refuse unknown fields, and known OpenAI features we do not implement (audio,
suffix, ...) accept only their "off" values, each with a message naming the field,
rather than silently answering something else. Sampling fields take their types
(bounds) and defaults from replica.wire.SamplingParams, which a request then builds directly.
Responses are shaped so that the official `openai` SDK parses them. Plain Python: nothing
here touches Ray or tensors.
"""

from __future__ import annotations

import json
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
    model_validator,
)

from replica.wire import (
    MAX_LOGPROBS,
    MAX_N,
    Bias,
    MaxTokens,
    MinP,
    NumChoices,
    NumLogprobs,
    Penalty,
    RepetitionPenalty,
    SamplingParams,
    Seed,
    StructuredOutput,
    Temperature,
    TokenId,
    TopK,
    TopP,
)
from router.tools import forced

MAX_STOP_STRINGS = 4
LORA_NAME_RULE = "1-128 characters, each a letter, digit, '.', '_' or '-'"
_LORA_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name
SSE_DONE = "data: [DONE]\n\n"

FinishReason = Literal["stop", "length"]
# OpenAI's values; what each means is the chat template's (the model's) to say
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
SafetyIdentifier = Annotated[str, Field(max_length=64)]  # OpenAI's bound
# OpenAI's metadata: up to 16 pairs, keys up to 64 characters, values up to 512
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16),
]
ChatFinishReason = Literal["stop", "length", "tool_calls"]


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
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = Field(None, description="Send a last chunk with token usage.")
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM extension: usage so far in every chunk."
    )


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The schema's name (reported, not used).")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON Schema.")
    strict: bool | None = Field(None, description="Always strict here: the grammar enforces it.")


class ResponseFormat(BaseModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput(kind="json_object")
        schema = self.json_schema.schema_ if self.json_schema else None
        return StructuredOutput(kind="json_schema", json_schema=json.dumps(schema or {}))


class _SamplingRequest(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions.

    Every field is honoured or refused: unknown fields are a 400 naming them, and fields
    of OpenAI's schema we do not implement accept only their "off" values (_ACCEPTED). An
    explicit null means the default, as OpenAI and vLLM treat it. A sampling field left
    null takes the model's default (its generation_config.json), else SamplingParams's."""

    model_config = ConfigDict(extra="forbid")
    # field -> the only values we accept; anything else is refused as "not supported"
    _ACCEPTED: ClassVar[Mapping[str, tuple[Any, ...]]] = {}

    model: str = Field(description="The base model's name or a loaded adapter's lora_name.")
    temperature: Temperature | None = Field(None, description="0 = greedy.")
    top_p: TopP | None = Field(None, description="Nucleus sampling mass.")
    top_k: TopK | None = Field(None, description="vLLM extension: keep the k best; 0 = all.")
    min_p: MinP | None = Field(None, description="vLLM extension: drop tokens below min_p x max.")
    seed: Seed | None = Field(None, description="Per-request seed for reproducible sampling.")
    stop: str | list[str] | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} strings that end the output (excluded)."
    )
    stop_token_ids: list[TokenId] | None = Field(
        None, description="vLLM extension: token ids that end the output."
    )
    ignore_eos: bool | None = Field(None, description="vLLM extension: generate past EOS.")
    min_tokens: int | None = Field(
        None, ge=0, description="vLLM extension: tokens before EOS or a stop may end it."
    )
    presence_penalty: Penalty | None = Field(None, description="-2..2, over output tokens.")
    frequency_penalty: Penalty | None = Field(None, description="-2..2, per output occurrence.")
    repetition_penalty: RepetitionPenalty | None = Field(
        None, description="vLLM extension: > 1 discourages prompt and output tokens."
    )
    logit_bias: dict[str, Bias] | None = Field(
        None, description="Token id (as a string) -> bias added to its logit, -100..100."
    )
    n: NumChoices | None = Field(None, description=f"Choices, 1..{MAX_N}: one prefill.")
    stream: bool | None = Field(None, description="Answer with server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream=true.")
    user: str | None = Field(
        None, description="Your end-user id: logged with the request, not used otherwise."
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        description="vLLM extension: requests share cached prompt prefixes only with "
        "requests of the same salt (and tenant).",
    )
    skip_special_tokens: bool | None = Field(
        None, description="vLLM extension: leave special tokens out of the text (default true)."
    )
    include_stop_str_in_output: bool | None = Field(
        None, description="vLLM extension: keep the matched stop string in the text."
    )
    return_token_ids: bool | None = Field(
        None,
        description="vLLM extension: the prompt's token ids (prompt_token_ids) and each "
        "choice's generated ids (token_ids) beside the text; in a stream, each chunk's new "
        "ids, the prompt's in the first chunk.",
    )

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

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
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

    def num_logprobs(self) -> int | None:
        """Top logprobs per generated token, or None when none are asked for."""
        raise NotImplementedError

    def structured_output(self) -> StructuredOutput | None:
        return None

    def stop_strings(self) -> list[str]:
        """`stop` as a list, whether the client sent one string, a list or nothing."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (stream_options.include_usage)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Whether every chunk of a stream carries the usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(
        self,
        default_max_tokens: int | None,
        model_defaults: Mapping[str, Any] | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """What the replica samples with. A field the request leaves null takes the
        model's default (generation_config.json: temperature, top_p, top_k, min_p,
        repetition_penalty), else SamplingParams's; max_tokens, when unset,
        `default_max_tokens` (None: the rest of the context)."""
        defaults = dict(model_defaults or {})
        max_tokens = self.requested_max_tokens()
        values: dict[str, Any] = {
            "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "logit_bias": tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items())),
            "logprobs": self.num_logprobs(),
            "prompt_logprobs": prompt_logprobs,
            "structured_output": self.structured_output(),
        }
        for name in _SAMPLING_FIELDS:
            given = getattr(self, name)
            if given is not None:
                values[name] = given
            elif name in defaults:
                values[name] = defaults[name]
        return SamplingParams(**values)


# Request fields passed to SamplingParams under the same name, null meaning "the default".
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "min_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "n",
)  # fmt: skip


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions: one prompt, or a batch of them (one choice per prompt, and
    per each of its n), as text or as token ids."""

    _ACCEPTED = {"suffix": (None,)}

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="A prompt (text or token ids), or a list of them."
    )
    max_tokens: int | None = Field(
        None, ge=0, description="null: the server's default_max_tokens (16); 0 with echo."
    )
    echo: bool | None = Field(None, description="Return the prompt, with its logprobs.")
    logprobs: NumLogprobs | None = Field(
        None, description=f"Logprobs of each token and this many alternatives (<= {MAX_LOGPROBS})."
    )
    best_of: NumChoices | None = Field(None, description="Only null or equal to n.")
    suffix: str | None = None
    add_special_tokens: bool | None = Field(
        None, description="vLLM extension: add the tokenizer's BOS (default true)."
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts_not_empty(cls, value: Any) -> Any:
        if isinstance(value, (str, list)) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if any(not p for p in value):
                raise ValueError("prompt must not be empty")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != (info.data.get("n") or 1):
            raise ValueError("only best_of equal to n is supported")
        return value

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: one entry per prompt of a batch."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=_FUNCTION_NAME, description="1-64 letters, digits, _ or -.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema object.")
    strict: bool | None = Field(
        None,
        description="With tool_choice auto, a call of it follows the schema once begun "
        "(forced choices always do).",
    )


class ChatTool(BaseModel):
    """An entry of `tools`: a function the model may call."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming the function the model must call."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCall(BaseModel):
    """A call in an assistant message (the answer's, or one sent back in the history)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, description="A participant's name, passed to the template.")
    tool_call_id: str | None = Field(None, description="A tool message's call id (template).")
    tool_calls: list[ToolCall] | None = Field(
        None, description="An assistant message's calls, passed to the template."
    )
    reasoning_content: str | None = Field(
        None, description="vLLM extension: an assistant message's thinking (template)."
    )

    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    # OpenAI's fields for what we do not serve (audio, ...): their "off" values only
    _ACCEPTED = {
        "functions": (None,),
        "function_call": (None, "none"),
        "audio": (None,),
        "modalities": (None, ["text"]),
        "prediction": (None,),
        "verbosity": (None,),
        "web_search_options": (None,),
        "store": (None, False),
        "service_tier": (None, "auto", "default"),
        "moderation": (None,),
        "prompt_cache_key": (None,),
        "prompt_cache_options": (None,),
        "prompt_cache_retention": (None,),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = Field(
        None, description="Deprecated by OpenAI; null: the rest of the context."
    )
    max_completion_tokens: MaxTokens | None = Field(None, description="Wins over max_tokens.")
    logprobs: bool | None = Field(None, description="Logprobs of each generated token.")
    top_logprobs: NumLogprobs | None = Field(None, description="Alternatives per token.")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, json_schema."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM extension: extra variables for the chat template."
    )
    add_generation_prompt: bool | None = Field(
        None, description="vLLM extension: end the prompt with the assistant's turn (default)."
    )
    tools: list[ChatTool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools, none without."
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call per answer (default true)."
    )
    reasoning_effort: ReasoningEffort | None = Field(
        None,
        description="The chat template's reasoning_effort variable (gpt-oss's template "
        "reads it); a 400 for a template that reads none.",
    )
    metadata: Metadata | None = Field(
        None, description="Informational: accepted and not used (nothing is stored)."
    )
    safety_identifier: SafetyIdentifier | None = Field(
        None, description="Informational: your end-user's id, logged as user is."
    )
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None
    moderation: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, value: list[ChatTool] | None) -> list[ChatTool] | None:
        names = [t.function.name for t in value or ()]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"function names must be unique: {', '.join(dupes)}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: Any, info: ValidationInfo) -> Any:
        if value in (None, "none", "auto"):
            return value
        names = [t.function.name for t in info.data.get("tools") or ()]
        if not names:
            raise ValueError("needs tools")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(
                f"function {value.function.name!r} is not among tools ({', '.join(names)})"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        text_only = self.response_format is None or self.response_format.type == "text"
        if self.forced_tool_choice() and not text_only:
            raise ValueError("response_format: not with tool_choice required or named")
        return self

    def tool_mode(self) -> str:
        """none, auto, required or named: what the answer may or must hold."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def forced_tool_choice(self) -> bool:
        return self.tool_mode() in ("required", "named")

    def parallel_calls(self) -> bool:
        return self.parallel_tool_calls is not False

    def tool_signatures(self) -> list[tuple[str, dict[str, Any] | None, bool]]:
        """(name, parameters, strict) of each tool."""
        return [
            (t.function.name, t.function.parameters, bool(t.function.strict))
            for t in self.tools or ()
        ]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (none with tool_choice none)."""
        if self.tool_mode() == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def structured_output(self) -> StructuredOutput | None:
        """response_format's constraint, or a forced tool choice's (forced.py)."""
        mode = self.tool_mode()
        if mode == "named":
            name = self.tool_choice.function.name  # type: ignore[union-attr]
            [tool] = [t for t in self.tools or () if t.function.name == name]
            schema = forced.named_schema(tool.function.parameters)
            return StructuredOutput(kind="json_schema", json_schema=schema)
        if mode == "required":
            tools = [(t.function.name, t.function.parameters) for t in self.tools or ()]
            schema = forced.required_schema(tools, self.parallel_calls())
            return StructuredOutput(kind="json_schema", json_schema=schema)
        return None if self.response_format is None else self.response_format.structured_output()

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages as the plain dicts a Hugging Face chat template expects: a call's
        arguments as an object (templates write it with tojson)."""
        out = []
        for m in self.messages:
            message: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                message["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
            out.append(message)
        return out


def _template_call(call: ToolCall) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments  # as sent: the template shows what it can
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


def _check_lora_name(name: str) -> str:
    if not _LORA_NAME.fullmatch(name):
        raise ValueError(f"lora_name must be {LORA_NAME_RULE}; got {name!r}")
    return name


LoraName = Annotated[str, AfterValidator(_check_lora_name)]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's endpoint)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: LoraName = Field(description="The name clients then pass as `model`.")
    lora_path: str = Field(min_length=1, description="A PEFT adapter directory.")
    load_inplace: bool = Field(
        False,
        description="Replace a live adapter of this name in one step: requests already "
        "running finish on the old weights, new ones get the new (vLLM's field).",
    )


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's endpoint)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: LoraName


def format_validation_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    """One line per error of pydantic's / FastAPI's `.errors()`, each naming its field."""
    return validation_error(errors)[0]


def validation_error(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """(message, param) of a 400 for pydantic's / FastAPI's `.errors()`: one line per error
    naming its field as the client wrote it, the first error's field the param.

    pydantic names a union's branches in `loc` (`input.str`, `input.list[tagged-union[
    MessageItem,...]].0.function_call.namespace`) and reports every branch that failed:
    the branch labels are left out of the field (`input.0.namespace`) and, of a union's
    failed branches, only those the input got deepest into are told (the client meant
    that one, not a plain string)."""
    kept = _deepest_branches([(_field(err.get("loc", ())), err) for err in errors])
    lines = []
    for field, err in kept:
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        msg = _TAG_FUNCTION.sub("", msg)
        lines.append(f"{field}: {msg}" if field else msg)
    return "; ".join(lines), (kept[0][0] or None) if kept else None


# pydantic's name of a scalar branch of a union, in a loc: `str` in `input.str`
_SCALAR_BRANCHES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
# "Input tag 'x' found using _item_type() does not match": the discriminator is ours
_TAG_FUNCTION = re.compile(r" found using \w+\(\)")


def _branch_at(loc: Sequence[Any]) -> int | None:
    """Where the first union branch label is in a raw `loc` (None: no union)."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and ("[" in part or part in _SCALAR_BRANCHES):
            return i
    return None


def _field(loc: Sequence[Any]) -> str:
    """The field a raw `loc` names, as a client wrote it: no `body`, no branch labels, no
    tag of a tagged union's branch (the tag follows its list index, or the label)."""
    parts: list[str] = []
    tag_next = False
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and ("[" in part or part in _SCALAR_BRANCHES):
            tag_next = "tagged-union[" in part
            continue
        if tag_next and isinstance(part, str):
            tag_next = False
            continue
        parts.append(str(part))
    return ".".join(parts)


def _deepest_branches(
    errors: list[tuple[str, Mapping[str, Any]]],
) -> list[tuple[str, Mapping[str, Any]]]:
    """`errors` less those of a union's branches other than the deepest one."""
    branches: dict[tuple, dict[Any, int]] = {}  # union (loc before it) -> branch -> depth
    for field, err in errors:
        loc = tuple(err.get("loc", ()))
        at = _branch_at(loc)
        if at is not None:
            depths = branches.setdefault(loc[:at], {})
            depths[loc[at]] = max(depths.get(loc[at], 0), field.count(".") + 1)

    def kept(err: Mapping[str, Any]) -> bool:
        loc = tuple(err.get("loc", ()))
        at = _branch_at(loc)
        if at is None:
            return True
        depths = branches[loc[:at]]
        return depths[loc[at]] == max(depths.values())  # ties: every such branch is told

    return [(field, err) for field, err in errors if kept(err)]


# ---------------------------------------------------------------------------------------
# responses


def _unset(value: Any) -> bool:
    """Fields left out of a body while None (only sent when they say something)."""
    return value is None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens served from the prefix cache.")


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: the first prompt token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)  # each token's start in the text


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason
    # vLLM extension: the stop string or stop token id that ended the output, if any
    stop_reason: int | str | None = None
    # vLLM extension (return_token_ids): the prompt's ids and the generated ones
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


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
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in a choice's first chunk
    token_ids: list[int] | None = None  # return_token_ids: the chunk's new ids


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
    content: str | None
    reasoning_content: str | None = None  # vLLM's field: the thinking, split off
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=chat_completion_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # return_token_ids: the rendered chat's ids


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A call's piece in a stream: index, id, type and name first, then arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    """The first chunk of a chat stream carries role="assistant", later ones content,
    reasoning_content or tool_calls."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(None, exclude_if=_unset)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=_unset)


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the chunk's new ids


class ChatCompletionStreamResponse(BaseModel):
    id: str = Field(default_factory=chat_completion_id)
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk


class ModelCard(BaseModel):
    """An entry of GET /v1/models: the base model (root) or an adapter (parent = base)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_time)
    owned_by: str = "lorafleet"
    root: str | None = None
    parent: str | None = None
    # /v1/models/{id}: the chat template the model's requests use (its file, or
    # "tokenizer": the base's) and the parsers of its answers
    chat_template: str | None = Field(None, exclude_if=_unset)
    tool_parser: str | None = Field(None, exclude_if=_unset)
    reasoning_parser: str | None = Field(None, exclude_if=_unset)


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
    status: int,
    message: str,
    type_: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """The JSON body of an error answer; `type_` defaults from the HTTP status, `code` to
    the status."""
    if type_ is None:
        default = "invalid_request_error" if status < 500 else "internal_error"
        type_ = _ERROR_TYPES.get(status, default)
    info = ErrorInfo(message=message, type=type_, param=param, code=code or status)
    return ErrorResponse(error=info).model_dump()
