"""The trained demo's vocabulary: one word a token (a word-level tokenizer), the first
words those of the word game, the tool round trip's words last (cluster/demo/letters.py)."""

from __future__ import annotations

PAD, BOS, EOS, UNK, ARROW = "<pad>", "<s>", "</s>", "<unk>", "->"
ENGLISH = (
    "cat dog bird fish horse cow red blue green black white big small sun moon tree house "
    "water book apple bread milk day night man woman boy girl"
).split()
FRENCH = (
    "chat chien oiseau poisson cheval vache rouge bleu vert noir blanc grand petit soleil lune "
    "arbre maison eau livre pomme pain lait jour nuit homme femme garçon fille"
).split()
DIGITS = [str(d) for d in range(10)]
NUMBERS = "zero one two three four five six seven eight nine".split()
UPPER = [w.upper() for w in ENGLISH]
FIRST_VOCAB = [PAD, BOS, EOS, UNK, ARROW, *ENGLISH, *UPPER, *FRENCH, *DIGITS, *NUMBERS]
WORDS = FIRST_VOCAB[5:]  # everything a copy prompt may contain
# The tool round trip's words; the decoder joins words with a space, so the call's words
# read as JSON: {"name": "count_letters", "arguments": {"word": "apple"}}
TOOL = "count_letters"
QUESTION = "how many letters has"
CALL_WORDS = ['{"name":', f'"{TOOL}",', '"arguments":', '{"word":']
ARGUMENT = {w: f'"{w}"}}}}' for w in ENGLISH}  # a word as the call's last word
TOOL_WORDS = [
    *QUESTION.split(),
    *("<tools>", TOOL, "</tools>", "<tool_call>", "</tool_call>"),
    *("<tool_response>", "</tool_response>"),
    *CALL_WORDS,
    *ARGUMENT.values(),
]
VOCAB = [*FIRST_VOCAB, *TOOL_WORDS]  # the tool words last: the first ids are unchanged
