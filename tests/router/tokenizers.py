"""Tokenizers the router tests build (no download): a Llama-2-style SentencePiece one, and
what a decode adds to a prompt's text."""

from __future__ import annotations

import functools
import string

import transformers

from cluster.demo.assets import CHAT_TEMPLATE

SP_WORDS = ["Hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]


@functools.cache
def sentencepiece_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer, built from a fixed vocabulary (no download, no training):
    a Unigram model with byte fallback ("<0xE6>" pieces for what it cannot spell), the
    Metaspace pre-tokenizer and decoder ("▁" marks a word start; the decode drops the first
    one), and BOS added to every encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ["<unk>", "<s>", "</s>"]
    singles = list(string.ascii_letters + string.digits + string.punctuation)
    vocab = [(t, 0.0) for t in specials] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    vocab += [("▁", -3.0)] + [(f"▁{w}", -1.0) for w in SP_WORDS]
    vocab += [(c, -5.0) for c in singles] + [(f"▁{c}", -5.5) for c in singles]
    model = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    model.decoder = decoders.Sequence(
        [
            decoders.Metaspace(replacement="▁", prepend_scheme="first"),
            decoders.ByteFallback(),
            decoders.Fuse(),
        ]
    )
    model.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def added_text(tokenizer, prompt_ids, output_ids, skip_special_tokens=True) -> str:
    """What the output adds to the prompt's text: decode(prompt + output) - decode(prompt)."""
    before = tokenizer.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    after = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=skip_special_tokens)
    assert after.startswith(before), (before, after)
    return after[len(before) :]
