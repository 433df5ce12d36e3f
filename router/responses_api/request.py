"""A Responses request, validated, and the chat completion request it means.

`input` is a string (one user message) or a list of items: messages (text parts only),
`function_call` items (the model's earlier calls, as the Agents SDK sends them back),
`function_call_output` items (their results) and `reasoning` items (earlier thinking,
given to the template as the next assistant message's reasoning_content). `instructions`
become a system message first. Fields of OpenAI's schema we do not serve accept only
their "off" values, as on chat.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
)

from replica.wire import MaxTokens, Temperature, TopP
from router import protocol as p


class ContentPart(BaseModel):
    """A message's text part (our own output_text parts come back with their extras)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None
    phase: Literal["final_answer"] | None = None  # ours, sent back: the answer itself

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made, sent back. The SDK's item carries `caller`, `namespace` and
    `async` too (None for a plain function call, as ours are): accepted when None."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    caller: None = None
    namespace: None = None
    async_: None = Field(None, alias="async")  # model_dump() writes async_, the wire async


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None
    caller: None = None
    name: str | None = None  # the function's, when the client names it: to the template
    namespace: None = None


class ReasoningText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    status: str | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(part.text for part in parts)


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    """A Responses function tool (flat: name beside type, not under `function`)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name or "output", "schema": self.schema_}
        return {"type": "json_schema", "json_schema": schema}


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: None = None


class ReasoningOptions(BaseModel):
    """`reasoning`: its effort is the chat template's reasoning_effort (as on chat); the
    summaries and modes of OpenAI's own reasoning models are not served (their off
    values only)."""

    model_config = ConfigDict(extra="forbid")

    effort: p.ReasoningEffort | None = None
    summary: None = None
    generate_summary: None = None
    context: Literal["auto"] | None = None
    mode: Literal["standard"] | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="forbid")
    # OpenAI's fields for what we do not serve: their "off" values only
    _ACCEPTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "store": (None, False),
        "background": (None, False),
        "conversation": (None,),
        "include": (None, []),
        "prompt": (None,),
        "top_logprobs": (None, 0),
        "truncation": (None, "disabled"),
        "service_tier": (None, "auto", "default"),
        "max_tool_calls": (None,),
        "stream_options": (None,),
        "prompt_cache_key": (None,),
        "prompt_cache_options": (None,),
        "prompt_cache_retention": (None,),
        "moderation": (None,),
        "image": (None,),
        "access_programs": (None,),
        "background_options": (None,),
        "context_management": (None,),
    }
    _WHY: ClassVar[dict[str, str]] = {
        "store": "responses are not stored (store: false)",
        "previous_response_id": "responses are not stored: send the whole conversation as input",
    }

    model: str = Field(description="The base model's name or a loaded adapter's lora_name.")
    input: str | list[InputItem] = Field(description="A user message, or a list of items.")
    instructions: str | None = Field(None, description="A system message before the input.")
    max_output_tokens: MaxTokens | None = Field(None, description="null: the rest of the context.")
    temperature: Temperature | None = Field(None, description="0 = greedy.")
    top_p: TopP | None = Field(None, description="Nucleus sampling mass.")
    tools: list[FunctionTool] | None = Field(None, description="Function tools.")
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = Field(
        None, description="As on chat: default auto with tools."
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call.")
    text: TextOptions | None = Field(None, description="format: text, json_object, json_schema.")
    stream: bool | None = Field(None, description="Answer with server-sent events.")
    user: str | None = Field(None, description="Logged with the request, not used otherwise.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM extension: extra variables for the chat template."
    )
    reasoning: ReasoningOptions | None = Field(
        None, description="effort: the chat template's reasoning_effort, as on chat."
    )
    metadata: p.Metadata | None = Field(
        None, description="Informational: repeated in the Response object, not used."
    )
    safety_identifier: p.SafetyIdentifier | None = Field(
        None, description="Informational: logged as user is, repeated in the Response."
    )
    previous_response_id: None = None
    store: Any = None
    background: Any = None
    conversation: Any = None
    include: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    service_tier: Any = None
    max_tool_calls: Any = None
    stream_options: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    background_options: Any = None
    context_management: Any = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[Any]) -> str | list[Any]:
        if isinstance(value, list) and not value:
            raise ValueError("input must not be empty")
        return value

    @field_validator("previous_response_id", mode="before")
    @classmethod
    def _not_stored(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(cls._WHY["previous_response_id"])
        return value

    @field_validator("*")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        accepted = cls._ACCEPTED.get(info.field_name or "")
        if accepted is not None and value not in accepted:
            why = cls._WHY.get(info.field_name or "", "not supported")
            raise ValueError(f"{info.field_name} is {why}" if why == "not supported" else why)
        return value

    def chat_request(self) -> p.ChatCompletionRequest:
        """The chat completion this asks for; pydantic's ValidationError if it is not one
        (a named function that is not in tools, ...)."""
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "stream": self.stream,
            "user": self.user,
            "safety_identifier": self.safety_identifier,
            "chat_template_kwargs": self.chat_template_kwargs,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
        }
        if self.tools is not None:
            fields["tools"] = [tool.chat_tool() for tool in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            name = self.tool_choice.name
            fields["tool_choice"] = {"type": "function", "function": {"name": name}}
        else:
            fields["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = self.text.format.response_format()
        return p.ChatCompletionRequest(**fields)

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: instructions first; a function_call item
        joins the assistant message before it (or starts one), its output a tool
        message; reasoning goes to the next assistant message."""
        out: list[dict[str, Any]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        thinking: str | None = None
        for item in self.input:
            if isinstance(item, ReasoningItem):
                thinking = (thinking or "") + item.text()
                continue
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and thinking is None:
                    last.setdefault("tool_calls", []).append(call)
                    continue
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                result = {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                if item.name is not None:  # as a chat tool message's name: the template's
                    result["name"] = item.name
                out.append(result)
                continue
            if out[-1]["role"] == "assistant" and thinking is not None:
                out[-1]["reasoning_content"], thinking = thinking, None
        return out

    def echo(self) -> dict[str, Any]:
        """The request's settings, as a Response object repeats them."""
        text_format = self.text.format if self.text is not None else None
        fmt = (
            {"type": "text"}
            if text_format is None
            else text_format.model_dump(by_alias=True, exclude_none=True)
        )
        tool_choice = self.tool_choice
        if isinstance(tool_choice, NamedFunction):
            tool_choice = tool_choice.model_dump()
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or ()],
            "tool_choice": tool_choice or ("auto" if self.tools else "none"),
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "text": {"format": fmt},
            "user": self.user,
            "safety_identifier": self.safety_identifier,
            "metadata": self.metadata or {},
            "reasoning": None if self.reasoning is None else self.reasoning.model_dump(),
        }
