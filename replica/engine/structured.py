"""Structured output (response_format, tool calls): grammars through xgrammar, host-side.

The tokenizer's info is read from the model directory at the first structured request
(most engines never see one); grammars are compiled when a request arrives, so a bad
schema is refused then (RequestError), and cached per schema text. Each structured
choice holds a matcher: it fills the choice's row of the step's token bitmask before the
draw and accepts the drawn token after the step's one device read. The tokenizer's special
tokens other than the stop tokens are never allowed: xgrammar reads a byte-level special
token such as `<s>` as its literal text, which a JSON string would accept.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from replica.errors import RequestError
from replica.wire import StructuredOutput

CACHE_SIZE = 64  # compiled grammars kept (schemas repeat: a client sends the same one)


class StructuredOutputs:
    def __init__(
        self,
        model_dir: str,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._compiler: Any = None
        self._allowed: torch.Tensor | None = None  # int32 words: all but special tokens
        self._grammars: OrderedDict[tuple[str, str | None], Any] = OrderedDict()

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher of the spec's grammar (compiled, or from the cache)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.grammar(spec))

    def grammar(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of a spec; RequestError if it is not a usable JSON schema."""
        key = (spec.kind, spec.json_schema)
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        grammar = self._compile(spec)
        self._grammars[key] = grammar
        if len(self._grammars) > self.cache_size:
            self._grammars.popitem(last=False)
        return grammar

    def bitmask(self, matchers: list[Any]) -> torch.Tensor:
        """int32 [len(matchers), ceil(V / 32)] on the host: row i allows the tokens
        matchers[i] accepts next, special tokens other than the stop tokens excepted."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(mask, i)
        if self._allowed is not None:
            mask &= self._allowed
        return mask

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._load_compiler()
        if spec.kind == "json_object":
            # an object (OpenAI's JSON mode; the builtin JSON grammar also allows a top-level
            # array) of any members, as free of whitespace as a schema's: no endless padding
            return compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        if spec.json_schema is None:
            raise RequestError(f"structured output {spec.kind}: no schema given")
        try:
            json.loads(spec.json_schema)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.json_schema)
            # one line, no free whitespace: a model cannot pad its output forever
            return compiler.compile_json_schema(spec.json_schema, any_whitespace=False)
        except Exception as e:  # invalid JSON, or a schema xgrammar cannot compile
            what = "structural tag" if spec.kind == "structural_tag" else "JSON schema"
            raise RequestError(f"invalid {what}: {_first_line(e)}") from None

    def _load_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            except (OSError, ValueError) as e:
                raise RequestError(
                    f"structured output needs the model's tokenizer: {_first_line(e)}"
                ) from None
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # ours is LRU
            added = getattr(tokenizer, "added_tokens_decoder", {})  # reserved tokens too
            special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
            self._allowed = _allowed_words(self.vocab_size, special - set(self.stop_token_ids))
        return self._compiler


def _allowed_words(vocab_size: int, banned: set[int]) -> torch.Tensor | None:
    """int32 [ceil(V / 32)] in xgrammar's bitmask layout: every token but `banned`."""
    banned = {t for t in banned if 0 <= t < vocab_size}
    if not banned:
        return None
    words = [0xFFFFFFFF] * -(-vocab_size // 32)
    for t in banned:
        words[t // 32] &= ~(1 << (t % 32))
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # as int32 holds them
    return torch.tensor(signed, dtype=torch.int32)


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
