"""What `lorafleet up` shows once the server runs: one request per adapter and one to the
base model, sent together so they share batches, answers side by side; then how to try more."""

from __future__ import annotations

import asyncio

import httpx

PROMPT = "The quick brown fox"  # for a model of the user's; the trained demo has its own


async def _ask(client: httpx.AsyncClient, url: str, model: str, prompt: str, n: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0}
    r = await client.post(f"{url}/v1/completions", json=body)
    if r.status_code != 200:
        return f"<HTTP {r.status_code}: {r.json().get('error', {}).get('message', r.text)}>"
    return r.json()["choices"][0]["text"]


async def _all(url: str, prompt: str, max_tokens: int) -> list[tuple[str, str]]:
    async with httpx.AsyncClient(timeout=120) as client:
        models = [m["id"] for m in (await client.get(f"{url}/v1/models")).json()["data"]]
        asks = (_ask(client, url, m, prompt, max_tokens) for m in models)
        texts = await asyncio.gather(*asks)
    return list(zip(models, texts))


def show(
    url: str, prompt: str = PROMPT, max_tokens: int = 16, notes: dict[str, str] | None = None
) -> list[str]:
    """Print the side-by-side answers, each with its model's note (what it was trained to
    do) if given; returns the model names (the base model first)."""
    results = asyncio.run(_all(url, prompt, max_tokens))
    notes = notes or {}
    width = max(len(m) for m, _ in results)
    answers = [repr(text.strip()) for _, text in results]
    answer_width = max(len(a) for a in answers)
    print(f"{len(results)} requests sent together, prompt {prompt!r}:")
    for (model, _), answer in zip(results, answers):
        note = f"  ({notes[model]})" if model in notes else ""
        print(f"  {model:>{width}} | {answer:<{answer_width}}{note}".rstrip())
    return [m for m, _ in results]


def try_it(url: str, model: str, prompt: str = PROMPT) -> str:
    return f"""
try it:
  curl {url}/v1/models
  curl {url}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{model}", "prompt": "{prompt}", "max_tokens": 16, "temperature": 0}}'
  python -c "import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.completions.create(model='{model}', prompt='{prompt}', max_tokens=16).choices[0].text)"
"""
