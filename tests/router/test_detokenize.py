"""Incremental detokenization and stop strings, on the demo model's byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest
import transformers

from cluster.demo.assets import DemoSpec, cached_demo_assets
from router.choices import IncrementalDetokenizer, StopStringMatcher
from tests.router.tokenizers import SP_WORDS, added_text, sentencepiece_tokenizer

MULTIBYTE = "héllo wörld ✓ 日本語 🙂"


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(cached_demo_assets(DemoSpec()).model_dir)


def stream(tokenizer, ids, skip_special_tokens=True, context_ids=()) -> tuple[list[str], str]:
    """(the delta of each add, the flushed tail)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, context_ids=context_ids)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush()


def test_multibyte_characters_are_never_split(tok):
    ids = tok(MULTIBYTE)["input_ids"]
    assert len(ids) > len(MULTIBYTE)  # several characters span several tokens
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) == MULTIBYTE and tail == ""
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas and "日" in deltas  # held back, then emitted whole


def test_random_unicode_text_round_trips(tok):
    rng = random.Random(0)
    alphabet = "abc xyz,.\n" + "éöüß" + "✓→€" + "日本語中文" + "🙂🚀"
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80)))
        deltas, tail = stream(tok, tok(text)["input_ids"])
        assert "".join(deltas) + tail == text
        assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_random_token_streams_match_the_full_decode(tok, seed, skip_special_tokens):
    # random ids include lone UTF-8 lead and continuation bytes and special tokens
    rng = random.Random(seed)
    ids = [rng.randrange(len(tok)) for _ in range(rng.choice([1, 7, 300]))]
    deltas, tail = stream(tok, ids, skip_special_tokens)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any(d.endswith("\ufffd") for d in deltas)  # a maybe-partial char is held


def test_byte_tokens_across_the_sliding_window(tok):
    # many 4-byte characters, one byte token each where the BPE has no merge for them,
    # interleaved with special tokens that skip_special_tokens drops
    text = "🙂" * 20 + "日本" * 10
    ids = [i for t in tok(text)["input_ids"] for i in (t, tok.eos_token_id)]
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) == text and tail == ""
    kept = "".join(stream(tok, ids, skip_special_tokens=False)[0])
    assert kept.count("</s>") == len(ids) // 2


def test_incomplete_character_at_the_end_is_flushed(tok):
    ids = tok("a日")["input_ids"][:-1]  # the last byte of 日 never arrives
    deltas, tail = stream(tok, ids)
    assert "".join(deltas) == "a" and tail == "\ufffd"
    assert "".join(deltas) + tail == tok.decode(ids)


def test_context_ids_are_not_emitted(tok):
    prompt, output = tok("Bonjour, ")["input_ids"], tok("ça va? 日本")["input_ids"]
    deltas, tail = stream(tok, output, context_ids=prompt)
    assert "".join(deltas) + tail == "ça va? 日本"


def test_context_ids_with_random_streams_add_what_the_full_decode_adds(tok):
    rng = random.Random(7)
    for _ in range(20):
        prompt = tok("".join(rng.choice("ab ✓日🙂,") for _ in range(rng.randint(1, 30))))
        output = tok("".join(rng.choice("cd ✓本🚀.") for _ in range(rng.randint(1, 60))))
        prompt_ids, output_ids = prompt["input_ids"], output["input_ids"]
        deltas, tail = stream(tok, output_ids, context_ids=prompt_ids)
        assert "".join(deltas) + tail == added_text(tok, prompt_ids, output_ids)
        assert all("\ufffd" not in d for d in deltas)


def test_sentencepiece_first_token_keeps_its_leading_space():
    sp = sentencepiece_tokenizer()
    prompt = sp("Hello world")["input_ids"]
    output = sp("the quick fox", add_special_tokens=False)["input_ids"]
    assert sp.convert_ids_to_tokens(output)[0] == "▁the"
    deltas, tail = stream(sp, output, context_ids=prompt)
    assert "".join(deltas) + tail == " the quick fox" == added_text(sp, prompt, output)
    assert deltas[0] == " the"
    # without the prompt as context the decoder drops the space (what the fix is for)
    assert "".join(stream(sp, output)[0]) == "the quick fox"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_sentencepiece_streams_equal_what_the_full_decode_adds(skip_special_tokens):
    """Byte fallback spells each byte of 日 or 🙂 as its own token, and decodes a run of
    them at once: an emitted character turns back into U+FFFD while the next one is
    incomplete. Deltas never carry that, and add up to the full decode's addition."""
    sp = sentencepiece_tokenizer()
    rng = random.Random(3)
    words = [*SP_WORDS, "日本語", "🙂", "ü", "x1", ",", "Straße"]
    for _ in range(30):
        prompt = sp(" ".join(rng.choices(words, k=rng.randint(1, 6))))["input_ids"]
        output = []
        for word in rng.choices(words, k=rng.randint(1, 25)):
            output += sp(" " + word, add_special_tokens=False)["input_ids"]
            if rng.random() < 0.1:  # an EOS between words: dropped, or decoded as "</s>"
                output.append(sp.eos_token_id)
        deltas, tail = stream(sp, output, skip_special_tokens, context_ids=prompt)
        assert "".join(deltas) + tail == added_text(sp, prompt, output, skip_special_tokens)
        assert all("\ufffd" not in d for d in deltas) and tail == ""


def test_sentencepiece_byte_fallback_across_the_sliding_window():
    sp = sentencepiece_tokenizer()
    ids = sp("日本語🙂" * 12, add_special_tokens=False)["input_ids"]
    assert len(ids) > 4 * IncrementalDetokenizer.CONTEXT  # all bytes: one token each
    deltas, tail = stream(sp, ids)
    assert "".join(deltas) == "日本語🙂" * 12 and tail == ""
    assert {len(d) for d in deltas} <= {0, 1}  # each character once, whole


def test_prompt_ending_inside_a_character():
    """A token-id prompt cut inside a character: the output that completes it carries it."""
    sp = sentencepiece_tokenizer()
    ids = sp("ok 日本", add_special_tokens=False)["input_ids"]
    prompt, output = ids[:-2], ids[-2:]  # the last two bytes of 本 come as output
    deltas, tail = stream(sp, output, context_ids=prompt)
    assert "".join(deltas) + tail == "本"


class CountingTokenizer:
    """Records the length of every decode call."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, skip_special_tokens=False):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decodes_a_bounded_window(tok):
    ids = tok(MULTIBYTE * 40)["input_ids"]
    spy = CountingTokenizer(tok)
    deltas, tail = stream(spy, ids)
    assert "".join(deltas) + tail == MULTIBYTE * 40
    # the window slides only where a character is complete: up to 3 more tokens (bytes)
    assert max(spy.lengths) <= 2 * IncrementalDetokenizer.CONTEXT + 4
    assert len(spy.lengths) < 2 * len(ids)


def feed_all(stop: list[str], deltas: list[str]) -> tuple[list[str], bool, str]:
    """(emitted text per feed, whether a stop was hit, flushed tail)."""
    matcher = StopStringMatcher(stop)
    out, hit = [], False
    for delta in deltas:
        text, hit = matcher.feed(delta)
        out.append(text)
        if hit:
            break
    return out, hit, matcher.flush()


def test_no_stop_strings_pass_text_through():
    assert feed_all([], ["a", "bc", ""]) == (["a", "bc", ""], False, "")


def test_stop_split_across_deltas():
    out, hit, _ = feed_all(["STOP"], ["hello S", "TO", "P world"])
    assert out == ["hello ", "", ""] and hit


def test_held_text_is_released_when_it_turns_out_not_to_stop():
    out, hit, tail = feed_all(["STOP"], ["a ST", "Ox", " ST"])
    assert out == ["a ", "STOx", " "] and not hit and tail == "ST"


def test_stop_at_the_very_start():
    matcher = StopStringMatcher(["\n"])
    assert matcher.feed("\nmore") == ("", True)
    assert matcher.matched == "\n"
    assert matcher.feed("later") == ("", True) and matcher.flush() == ""


def test_overlapping_prefix():
    out, hit, _ = feed_all(["ab"], list("aab"))
    assert "".join(out) == "a" and hit
    assert feed_all(["aab"], list("aaab"))[0] == ["", "", "a", ""]


def test_several_stop_strings():
    matcher = StopStringMatcher(["END", "\n\n", "bc"])
    assert matcher.feed("x\n") == ("x", False)
    assert matcher.feed("yEN") == ("\ny", False)
    assert matcher.feed("D\n\n") == ("", True)
    assert matcher.matched == "END"


def test_stop_completed_first_wins():
    # read one character at a time, "bc" completes before "abcd" would
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.feed("xabcd") == ("xa", True) and matcher.matched == "bc"
    # ending together, the longer one is cut
    matcher = StopStringMatcher(["bc", "abc"])
    assert matcher.feed("xabc") == ("x", True) and matcher.matched == "abc"


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""])


def reference_cut(text: str, stop: list[str]) -> tuple[str, bool]:
    """Read character by character; cut before the first stop string to end."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if text[:end].endswith(s)]
        if ending:
            return text[: end - max(map(len, ending))], True
    return text, False


@pytest.mark.parametrize("seed", range(50))
def test_random_splits_match_the_reference(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("aab c") for _ in range(rng.randint(0, 30)))
    stop = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(3)]
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    out, hit, tail = feed_all(stop, deltas)
    assert ("".join(out) + tail, hit) == reference_cut(text, stop)


def test_detokenizer_and_matcher_together(tok):
    detok, matcher = IncrementalDetokenizer(tok), StopStringMatcher(["日本", "🙂"])
    out = []
    for token_id in tok(MULTIBYTE)["input_ids"]:
        text, hit = matcher.feed(detok.add(token_id))
        out.append(text)
        if hit:
            break
    assert "".join(out) == "héllo wörld ✓ " and matcher.matched == "日本"
