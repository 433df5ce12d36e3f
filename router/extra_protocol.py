"""The ingress's requests beyond OpenAI's API: vLLM's /tokenize and /detokenize.
Plain Python: nothing here touches Ray or tensors."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.protocol import ChatMessage, ChatTool


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt (as /v1/completions tokenizes it) or a conversation (as
    /v1/chat/completions does, through the chat template)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="The base model or an adapter (same tokenizer).")
    prompt: str | None = Field(None, description="Text to tokenize; or give messages.")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="A conversation, rendered by the chat template."
    )
    tools: list[ChatTool] | None = Field(
        None, description="Messages only: tools, rendered by the chat template."
    )
    add_special_tokens: bool | None = Field(
        None,
        description="Add the tokenizer's special tokens (BOS): default true for a "
        "prompt, false for messages (the template writes them).",
    )
    add_generation_prompt: bool | None = Field(
        None, description="Messages only: end with the assistant's turn (default true)."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Messages only: extra variables for the chat template."
    )

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None and (
            self.add_generation_prompt is not None
            or self.chat_template_kwargs is not None
            or self.tools is not None
        ):
            raise ValueError("add_generation_prompt, chat_template_kwargs and tools need messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids back to text (special tokens kept)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="The base model or an adapter (same tokenizer).")
    tokens: list[int] = Field(description="Token ids of the model's vocabulary.")


class DetokenizeResponse(BaseModel):
    prompt: str
