"""The trained demo's tool-calling adapter, `letters`: its task, its chat template, the
function it calls and the data it learns from.

Asked how many letters a word has, with count_letters offered, it writes a Hermes call,
`<tool_call> {"name": "count_letters", "arguments": {"word": "apple"}} </tool_call>`
(words of the vocabulary that the decoder joins with spaces into JSON); given the
function's result in a tool message, it answers `apple has five letters`. Its template,
shipped in its directory, writes the offered tools' names, the last question, the calls
and results as those words, so the server chooses the hermes parser from it.
"""

from __future__ import annotations

import json
import random

from cluster.demo.words import ENGLISH, NUMBERS, QUESTION, TOOL

NAME = "letters"  # the adapter
TASK = f"how many letters a word has, by calling {TOOL}"
SHOWCASE_QUESTION = f"{QUESTION} apple"  # what `lorafleet up` asks it
# The adapter's own template: the tools' names, the last user message, then the
# calls, results and answers after it; `->` where the model answers.
TEMPLATE = (
    "{%- set ns = namespace(last=0) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{%- if tools %}<tools>{% for t in tools %} "
    "{{ t.function.name if t.function is defined else t.name }}{% endfor %} </tools> "
    "{% endif %}"
    "{%- for m in messages[ns.last:] %}"
    "{%- if m.role == 'user' %}{{ m.content }}{% if not loop.last %} ->{% endif %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
    ' <tool_call> {"name": {{ c.function.name | tojson }}, '
    '"arguments": {{ c.function.arguments | tojson }}} </tool_call>{% endfor %}'
    "{%- elif m.role == 'tool' %} <tool_response> {{ m.content }} </tool_response>"
    "{%- elif m.role == 'assistant' %} {{ m.content }}"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %} ->{% endif %}"
)


COUNT_LETTERS_TOOL = {  # count_letters as an OpenAI chat tool
    "type": "function",
    "function": {
        "name": TOOL,
        "description": "How many letters a word has.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string"}},
            "required": ["word"],
        },
    },
}


def count_letters(word: str) -> int:
    """How many letters `word` has: the function the adapter calls."""
    return len(word)


def call(word: str) -> str:
    """The adapter's call of count_letters on `word`, as it writes it."""
    arguments = json.dumps({"word": word})
    return f'<tool_call> {{"name": "{TOOL}", "arguments": {arguments}}} </tool_call>'


def examples(n: int, seed: int) -> list[tuple[str, str]]:
    """n (prompt, answer) pairs for the adapter, as its template writes the
    prompts: half ask (answer: the call), half hold the call and its result (answer: the
    result in words). The results are random digits, not the true counts, so the answer
    can only come from the tool message."""
    rng = random.Random(f"{NAME}/{seed}")
    out = []
    for _ in range(n):
        word = rng.choice(ENGLISH)
        ask = f"<tools> {TOOL} </tools> {QUESTION} {word} ->"
        if rng.random() < 0.5:
            out.append((ask, call(word)))
            continue
        result = rng.randrange(10)
        prompt = f"{ask} {call(word)} <tool_response> {result} </tool_response> ->"
        out.append((prompt, f"{word} has {NUMBERS[result]} letters"))
    return out
