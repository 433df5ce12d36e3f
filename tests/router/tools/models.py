"""Copies of the tiny model with chat templates that take tools and think (Qwen-style),
for the tool-calling tests; and a replica script answering a fixed text."""

from __future__ import annotations

import shutil
from pathlib import Path

from replica.wire import GenerateRequest, Reply
from tests.conftest import tiny_assets

# Hermes calls, as Qwen2.5's template writes them (shortened); <think> as Qwen3's
HERMES_TEMPLATE = """{{ bos_token }}
{%- if tools %}<|system|>
You may call functions. Their signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>{{ eos_token }}
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>
{%- for call in m.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}{{ eos_token }}
{% elif m.role == 'tool' %}<|tool|>
<tool_response>{{ m.content }}</tool_response>{{ eos_token }}
{% else %}<|{{ m.role }}|>
{{ m.content }}{{ eos_token }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


def model_with_template(root: Path, template: str = HERMES_TEMPLATE) -> str:
    """A copy of the tiny Llama at `root` whose chat template is `template`."""
    source = tiny_assets("llama").model_dir
    shutil.copytree(source, root, dirs_exist_ok=True)
    (root / "chat_template.jinja").write_text(template)
    return str(root)


def answering(tokenizer, text: str, per_token: bool = False):
    """A FakeReplicas script that generates `text` (one reply, or one per token)."""
    ids = tokenizer.encode(text, add_special_tokens=False)

    def script(request: GenerateRequest) -> list[Reply]:
        n = len(request.prompt_ids)
        if not per_token:
            return [Reply(tuple(ids), "stop", num_prompt_tokens=n)]
        last = len(ids) - 1
        return [
            Reply((t,), "stop" if i == last else None, num_prompt_tokens=n)
            for i, t in enumerate(ids)
        ]

    return script
