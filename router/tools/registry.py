"""Tool-call and reasoning parsers by name, and the ones a chat template implies.

A template that writes a format's markers gets that format's parser without
configuration; the config's tool_parser / reasoning_parser (per model, per adapter)
override it, "none" turning it off.
"""

from __future__ import annotations

from router.tools.hermes import HERMES
from router.tools.llama import LLAMA3_JSON
from router.tools.mistral import MISTRAL
from router.tools.tagged import CallFormat

TOOL_PARSERS: dict[str, CallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
# gpt-oss: channels carry both thinking and calls, one parser for the two (harmony.py)
HARMONY = "harmony"
TOOL_PARSER_NAMES = (*TOOL_PARSERS, HARMONY)
REASONING_PARSERS = ("think", HARMONY)
NONE = "none"


def tool_parser_of(template: str | None) -> str | None:
    """The tool parser `template` (a chat template's text) implies; None if none does."""
    text = template or ""
    if "<|channel|>" in text:
        return HARMONY
    if "<tool_call>" in text:
        return HERMES.name
    if "[TOOL_CALLS]" in text:
        return MISTRAL.name
    if "<|python_tag|>" in text or ("ipython" in text and '"parameters"' in text):
        return LLAMA3_JSON.name
    return None


def reasoning_parser_of(template: str | None) -> str | None:
    """The reasoning parser `template` implies: "think" if it writes `<think>`,
    "harmony" if it writes gpt-oss's channels."""
    text = template or ""
    if "<|channel|>" in text:
        return HARMONY
    return "think" if "<think>" in text else None


def check_tool_parser(name: str | None) -> str | None:
    """`name` if it names a tool parser (or "none"); ValueError listing them else."""
    if name is not None and name != NONE and name not in TOOL_PARSER_NAMES:
        known = ", ".join(TOOL_PARSER_NAMES)
        raise ValueError(f"unknown tool parser {name!r}; known: {known}, none")
    return name


def check_reasoning_parser(name: str | None) -> str | None:
    if name is not None and name != NONE and name not in REASONING_PARSERS:
        known = ", ".join(REASONING_PARSERS)
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}, none")
    return name
