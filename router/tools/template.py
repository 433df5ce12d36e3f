"""A model's or an adapter's chat template, the parsers chosen for what it makes the model
write, rendering a conversation through it (tools included), and the parser a request
reads its answer with.

The base model's template is its tokenizer's; an adapter directory's `chat_template.jinja`
(or the `chat_template` of its tokenizer_config.json) replaces it for that adapter's
requests, with parsers chosen from it. Parsers a config names win over the template's.
"""

from __future__ import annotations

import fnmatch
import functools
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import meta
from transformers.utils.chat_template_utils import _compile_jinja_template

from replica.wire import StructuredOutput
from router.tools import registry
from router.tools.events import Chain, PlainText, StreamParser
from router.tools.forced import NamedCallParser, RequiredCallsParser, strict_tag
from router.tools.harmony import HarmonyParser
from router.tools.reasoning import START as THINK_START
from router.tools.reasoning import ThinkParser
from router.tools.tagged import TaggedCallParser

TEMPLATE_FILE = "chat_template.jinja"
CACHE_SIZE = 4096  # adapter versions whose template is kept (read again when evicted)
# a tokenizer_config.json may hold a vocabulary: large, but not without bound
MAX_TEMPLATE_FILE_BYTES = 16 << 20


@dataclass(frozen=True)
class ChatTemplate:
    """None fields: the tokenizer's template (text), no parser of that kind."""

    text: str | dict[str, str] | None  # a Jinja source, or transformers' named templates
    source: str  # where it comes from: "tokenizer" or a file's path
    tool_parser: str | None
    reasoning_parser: str | None

    @classmethod
    def chosen(
        cls,
        text: str | dict[str, str] | None,
        source: str,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> ChatTemplate:
        """The template with its parsers: those named ("none": off), else the ones its
        text implies."""
        whole = "\n".join(text.values()) if isinstance(text, dict) else text
        tool = registry.tool_parser_of(whole) if tool_parser is None else tool_parser
        reasoning = (
            registry.reasoning_parser_of(whole) if reasoning_parser is None else reasoning_parser
        )
        none = registry.NONE
        return cls(
            text,
            source,
            None if tool == none else registry.check_tool_parser(tool),
            None if reasoning == none else registry.check_reasoning_parser(reasoning),
        )

    def special_tokens(self, tool_mode: str) -> bool:
        """Whether answers are decoded keeping special tokens: the parsers that read them
        (harmony's channels always, Mistral's calls with tool_choice auto) see markers."""
        if registry.HARMONY in (self.tool_parser, self.reasoning_parser):
            return tool_mode in ("none", "auto")
        fmt = registry.TOOL_PARSERS.get(self.tool_parser or "")
        return tool_mode == "auto" and fmt is not None and fmt.special_tokens

    def text_for(self, tools: list[dict[str, Any]] | None) -> str | None:
        """The template text a conversation with `tools` renders with: of named templates,
        the tool one when there are tools, else the default (None: the tokenizer's)."""
        text = self.text
        if isinstance(text, dict):
            text = text.get("tool_use") if tools and "tool_use" in text else text.get("default")
        return text

    def variables(self, tokenizer: Any, tools: list[dict[str, Any]] | None) -> frozenset[str]:
        """The variables the template `render` picks for `tools` reads from its context.
        One passed that is not among them would change nothing, so chat_template_kwargs
        and reasoning_effort are checked against these."""
        return _variables(tokenizer.get_chat_template(self.text_for(tools), tools))

    def render(
        self,
        tokenizer: Any,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any],
    ) -> str:
        """The conversation as the prompt's text (transformers' apply_chat_template)."""
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=self.text_for(tools),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )

    def strict_calls(
        self, tools: Sequence[tuple[str, Mapping[str, Any] | None, bool]]
    ) -> StructuredOutput | None:
        """The constraint on `auto` answers when some tool is strict ((name, parameters,
        strict) triples): a call, once begun in this template's format, follows its
        tool's schema. None without strict tools or for a format the grammar cannot
        follow (markers that are special tokens)."""
        fmt = registry.TOOL_PARSERS.get(self.tool_parser or "")
        if fmt is None or fmt.wrap is None or fmt.trigger is None:
            return None
        tag = strict_tag(fmt.wrap, fmt.trigger, tools)
        return None if tag is None else StructuredOutput(kind="structural_tag", json_schema=tag)

    def card(self) -> dict[str, str | None]:
        """What /v1/models/{id} says of it."""
        return {
            "chat_template": self.source,
            "tool_parser": self.tool_parser,
            "reasoning_parser": self.reasoning_parser,
        }


def answer_parser(
    template: ChatTemplate, tool_mode: str, named: str | None, prompt: str
) -> StreamParser:
    """How a request's answer reads: a forced choice's JSON, else thinking (when the
    template has a reasoning parser) then the answer's calls (with tool_choice auto)."""
    if tool_mode == "named":
        return NamedCallParser(named or "")
    if tool_mode == "required":
        return RequiredCallsParser()
    if registry.HARMONY in (template.tool_parser, template.reasoning_parser):
        return HarmonyParser(calls=tool_mode == "auto" and template.tool_parser == registry.HARMONY)
    parser: StreamParser = PlainText()
    if tool_mode == "auto" and template.tool_parser is not None:
        parser = TaggedCallParser(registry.TOOL_PARSERS[template.tool_parser])
    if template.reasoning_parser is not None:
        opened = prompt.rstrip().endswith(THINK_START)
        parser = Chain(ThinkParser(opened), parser)
    return parser


@functools.lru_cache(maxsize=256)
def _variables(source: str) -> frozenset[str]:
    # parsed by the environment transformers renders it with (its extensions and tags)
    environment = _compile_jinja_template(source).environment
    return frozenset(meta.find_undeclared_variables(environment.parse(source)))


def adapter_template_text(adapter_dir: str) -> tuple[str, str] | None:
    """(template text, its file) an adapter directory ships, or None: its
    chat_template.jinja, else its tokenizer_config.json's chat_template. Only files inside
    the directory (symlinks resolved; the store checked it lies in the adapter roots) and
    under MAX_TEMPLATE_FILE_BYTES are read."""
    root = Path(adapter_dir).resolve()
    jinja = _inside(root, TEMPLATE_FILE)
    if jinja is not None:
        return jinja.read_text(), str(jinja)
    config = _inside(root, "tokenizer_config.json")
    if config is not None:
        try:
            text = json.loads(config.read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError):
            return None
        if isinstance(text, str) and text:
            return text, str(config)
    return None


def _inside(root: Path, name: str) -> Path | None:
    path = (root / name).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        return None
    return path if path.stat().st_size <= MAX_TEMPLATE_FILE_BYTES else None


class Templates:
    """The base model's template and each adapter version's, chosen once per version: the
    adapter's own file if it ships one, else the base's text; its parsers from the first
    `adapter_parsers` glob matching its name, else from its text (the base's when
    inherited)."""

    def __init__(
        self,
        base: ChatTemplate,
        adapter_parsers: Mapping[str, Any] = {},  # glob -> an object with the two fields
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self.base = base
        self.adapter_parsers = dict(adapter_parsers)
        self.cache_size = cache_size
        self._adapters: OrderedDict[tuple[str, int], ChatTemplate] = OrderedDict()

    def of(self, name: str, version: int, path: str) -> ChatTemplate:
        key = (name, version)
        template = self._adapters.get(key)
        if template is None:
            template = self._adapters[key] = self._choose(name, path)
            if len(self._adapters) > self.cache_size:
                self._adapters.popitem(last=False)
        self._adapters.move_to_end(key)
        return template

    def _choose(self, name: str, path: str) -> ChatTemplate:
        override = next(
            (v for glob, v in self.adapter_parsers.items() if fnmatch.fnmatchcase(name, glob)),
            None,
        )
        tool = getattr(override, "tool_parser", None)
        reasoning = getattr(override, "reasoning_parser", None)
        own = adapter_template_text(path) if Path(path).is_dir() else None
        if own is not None:
            return ChatTemplate.chosen(own[0], own[1], tool, reasoning)
        if override is None:
            return self.base
        base = self.base
        return ChatTemplate.chosen(
            base.text,
            base.source,
            tool or base.tool_parser or registry.NONE,
            reasoning or base.reasoning_parser or registry.NONE,
        )
