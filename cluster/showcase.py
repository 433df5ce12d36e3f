"""What `lorafleet up` shows once the server runs: one request per adapter and one to the
base model, sent together so they share batches, answers side by side; then how to try more."""

from __future__ import annotations

import asyncio

import httpx

PROMPT = "The quick brown fox"


async def _ask(client: httpx.AsyncClient, url: str, model: str, max_tokens: int) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    r = await client.post(f"{url}/v1/completions", json=body)
    if r.status_code != 200:
        return f"<HTTP {r.status_code}: {r.json().get('error', {}).get('message', r.text)}>"
    return r.json()["choices"][0]["text"]


async def _all(url: str, max_tokens: int) -> list[tuple[str, str]]:
    async with httpx.AsyncClient(timeout=120) as client:
        models = [m["id"] for m in (await client.get(f"{url}/v1/models")).json()["data"]]
        texts = await asyncio.gather(*(_ask(client, url, m, max_tokens) for m in models))
    return list(zip(models, texts))


def show(url: str, max_tokens: int = 16) -> None:
    results = asyncio.run(_all(url, max_tokens))
    width = max(len(m) for m, _ in results)
    print(f"{len(results)} requests sent together, prompt {PROMPT!r}:")
    for model, text in results:
        print(f"  {model:>{width}} | {text!r}")


def try_it(url: str) -> str:
    return f"""
try it:
  curl {url}/v1/models
  curl {url}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "adapter-00", "prompt": "Hello", "max_tokens": 16, "temperature": 0}}'
  python -c "import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.completions.create(model='adapter-01', prompt='Hello', max_tokens=16).choices[0].text)"
"""
