"""The trained demo (assets/demo-trained, cluster/demo/training.py): each adapter does its
task on held-out inputs, the same inside a batch shared with every other adapter as alone,
and our engine gives what transformers + PEFT give."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from cluster.cli import main
from cluster.demo import letters, words
from cluster.demo import training as dt
from cluster.offline import GenerateRequest, OfflineGenerator
from replica.config import EngineConfig
from replica.wire import SamplingParams
from tests.net import free_port
from tests.oracle import hf_logits, hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12)
HELD_OUT = 30  # per task, drawn with another seed than training
MIN_ACCURACY = 0.9  # exact match; measured 2026-11-24: every task 30/30 (docs/getting-started.md)


@pytest.fixture(scope="module")
def assets():
    return dt.demo_assets()


@pytest.fixture(scope="module")
def generator(assets):
    config = EngineConfig(
        model=str(assets.model_dir), device="cpu", adapters={"num_slots": len(assets.adapters) + 1}
    )
    gen = OfflineGenerator(config, {n: str(p) for n, p in assets.adapters.items()})
    yield gen
    gen.close()


def _requests() -> list[tuple[str | None, str, str]]:
    """(task, prompt, expected answer) for the base model and every task, interleaved."""
    per_task = [
        [(task, p, a) for p, a in dt.examples(task, HELD_OUT, dt.HELD_OUT_SEED)]
        for task in [None, *dt.TASKS]
    ]
    return [r for group in zip(*per_task) for r in group]


def test_committed_assets_hold_every_task(assets):
    assert list(assets.adapters) == [*dt.TASKS, letters.NAME]
    for path in [assets.model_dir / "model.safetensors", *assets.adapters.values()]:
        assert path.exists(), path
    train = {p for task in [None, *dt.TASKS] for p, _ in dt.examples(task, 2000, dt.TRAIN_SEED)}
    held_out = {p for _, p, _ in _requests()}
    assert len(held_out - train) >= len(held_out) // 2  # mostly unseen prompts


def test_every_adapter_does_its_task_in_one_shared_batch(generator):
    requests = _requests()
    results = generator.generate([GenerateRequest(p, task, GREEDY) for task, p, _ in requests])
    correct: dict[str | None, int] = {}
    for (task, _, answer), result in zip(requests, results):
        correct[task] = correct.get(task, 0) + (result.text.strip() == answer)
    accuracy = {task or "base": n / HELD_OUT for task, n in correct.items()}
    assert all(a >= MIN_ACCURACY for a in accuracy.values()), accuracy


def test_outputs_in_a_shared_batch_equal_outputs_alone(generator):
    requests = _requests()[: 2 * (len(dt.TASKS) + 1)]  # two of each, all in one batch
    batched = generator.generate([GenerateRequest(p, t, GREEDY) for t, p, _ in requests])
    for (task, prompt, _), together in zip(requests, batched):
        [alone] = generator.generate([GenerateRequest(prompt, task, GREEDY)])
        assert together.output_token_ids == alone.output_token_ids, (task, prompt)


@pytest.mark.parametrize("task", ["reverse", "french"])
def test_engine_equals_transformers_peft(generator, assets, task):
    """Every token we pick greedily, up to and with </s>, is transformers + PEFT's argmax on
    the same prefix (teacher-forced: the same as greedy decoding, without forcing either
    model past </s>)."""
    model = hf_model(assets.model_dir, assets.adapters[task])
    for prompt, _ in dt.examples(task, 3, dt.HELD_OUT_SEED):
        [ours] = generator.generate([GenerateRequest(prompt, task, GREEDY)])
        assert ours.output_token_ids[-1] == model.config.eos_token_id, prompt
        sequence = ours.prompt_token_ids + ours.output_token_ids
        logits = hf_logits(model, sequence[:-1])[len(ours.prompt_token_ids) - 1 :]
        assert logits.argmax(-1).tolist() == ours.output_token_ids, prompt


def _letters_requests() -> list[tuple[str, str]]:
    """(prompt, answer): the call for every word, then held-out calls with results."""
    asks = [
        (f"<tools> {letters.TOOL} </tools> {letters.QUESTION} {w} ->", w) for w in letters.ENGLISH
    ]
    calls = [(prompt, letters.call(word)) for prompt, word in asks]
    return calls + letters.examples(HELD_OUT, dt.HELD_OUT_SEED)


def test_letters_adapter_calls_count_letters_then_answers_with_its_result(generator):
    requests = _letters_requests()
    results = generator.generate([GenerateRequest(p, letters.NAME, GREEDY) for p, _ in requests])
    wrong = [(p, a, r.text) for (p, a), r in zip(requests, results) if r.text.strip() != a]
    assert len(wrong) <= (1 - MIN_ACCURACY) * len(requests), wrong
    # what `lorafleet up` asks
    question = f"<tools> {letters.TOOL} </tools> {letters.SHOWCASE_QUESTION} ->"
    [asked] = generator.generate([GenerateRequest(question, letters.NAME, GREEDY)])
    assert asked.text.strip() == letters.call("apple")
    assert json.loads(asked.text.split("<tool_call>")[1].split("</tool_call>")[0]) == {
        "name": letters.TOOL,
        "arguments": {"word": "apple"},
    }


def test_letters_template_writes_the_prompts_it_was_trained_on(assets):
    """The adapter's chat_template.jinja (served for its requests) renders a conversation
    as letters.examples writes it: the tools, the last question, the call with the
    arguments the server hands it (an object), the result; and the Hermes parser is
    chosen from it."""
    from transformers import AutoTokenizer

    from router.tools.registry import tool_parser_of

    template = (assets.adapters[letters.NAME] / "chat_template.jinja").read_text()
    assert template.strip() == letters.TEMPLATE and tool_parser_of(template) == "hermes"
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    vocabulary = set(tokenizer.get_vocab())
    earlier = [
        {"role": "system", "content": "ignored"},
        {"role": "user", "content": "cat 7"},
        {"role": "assistant", "content": "cat 7"},
    ]
    for prompt, _ in letters.examples(20, dt.TRAIN_SEED):
        word = prompt.split(" -> ")[0].split()[-1] if " -> " in prompt else prompt.split()[-2]
        messages = [*earlier, {"role": "user", "content": f"{letters.QUESTION} {word}"}]
        if "<tool_response>" in prompt:
            result = prompt.split("<tool_response> ")[1].split()[0]
            call = {"id": "call_1", "type": "function"}
            call["function"] = {"name": letters.TOOL, "arguments": {"word": word}}
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": result},
            ]
        rendered = tokenizer.apply_chat_template(
            messages,
            tools=[letters.COUNT_LETTERS_TOOL],
            chat_template=template,
            tokenize=False,
            add_generation_prompt=True,
        )
        assert rendered == prompt
        assert set(prompt.split()) <= vocabulary


def test_the_tool_words_decode_as_json(assets):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    for word in letters.ENGLISH:
        ids = tokenizer(letters.call(word))["input_ids"]
        assert tokenizer.unk_token_id not in ids
        body = tokenizer.decode(ids).removeprefix("<tool_call>").removesuffix("</tool_call>")
        assert json.loads(body) == {"name": letters.TOOL, "arguments": {"word": word}}


def test_learning_the_tool_words_changes_no_other_weight(monkeypatch):
    """Only the new rows of the embedding and the output layer train (a tiny model, two
    steps): every other weight, and so the first words' logits, stay as they were."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(dt, "TOOL_WORDS_STEPS", 2)
    monkeypatch.setattr(dt, "BATCH", 4)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(words.FIRST_VOCAB), hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[5, 6, 4]])
    with torch.no_grad():
        before = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    extended = dt._learn_tool_words(model, dt._tokenizer(), lambda line: None)
    first = len(words.FIRST_VOCAB)
    assert extended.config.vocab_size == len(words.VOCAB)
    for name, weight in extended.state_dict().items():
        old = state[name]
        if weight.shape != old.shape:  # the embedding and lm_head: the new rows trained
            assert torch.equal(weight[:first], old)
            assert not torch.equal(weight[first:], torch.zeros_like(weight[first:]))
        else:
            assert torch.equal(weight, old), name
    with torch.no_grad():
        after = extended.eval()(ids).logits
    # the same weights; a wider output matmul may round the last bit otherwise
    torch.testing.assert_close(after[..., :first], before, rtol=0, atol=1e-6)


@pytest.mark.slow  # 16 training steps: seconds on an idle 2-core CPU, ~50 s on a loaded one
def test_train_writes_the_demo_with_the_tool_words_and_letters(tmp_path, monkeypatch):
    """train() end to end at a few steps each: every adapter, letters with its template,
    the base model with every word, the first adapters never holding the new rows."""
    from safetensors import safe_open

    for steps in ("BASE_STEPS", "ADAPTER_STEPS", "TOOL_WORDS_STEPS", "LETTERS_STEPS"):
        monkeypatch.setattr(dt, steps, 2)
    monkeypatch.setattr(dt, "BATCH", 4)
    assets = dt.train(tmp_path / "demo", log=lambda line: None)
    assert list(assets.adapters) == [*dt.TASKS, letters.NAME]
    config = json.loads((assets.model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(words.VOCAB)
    template = (assets.adapters[letters.NAME] / "chat_template.jinja").read_text()
    assert template.strip() == letters.TEMPLATE
    for path in assets.adapters.values():
        with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
            assert all("lora_A" in k or "lora_B" in k for k in f.keys())


def test_demo_assets_trained_points_at_and_copies_the_committed_files(tmp_path, capsys):
    assert main(["demo-assets", "--trained"]) == 0
    out = capsys.readouterr().out
    assert f"model:    {dt.ROOT / 'model'}" in out
    assert all(f"adapter:  {n}={dt.ROOT / 'adapters' / n}" in out for n in dt.TASKS)
    assert main(["demo-assets", "--trained", "--out", str(tmp_path / "copy")]) == 0
    copy = dt.demo_assets(tmp_path / "copy")
    for name, path in dt.demo_assets().adapters.items():
        original = (path / "adapter_model.safetensors").read_bytes()
        assert (copy.adapters[name] / "adapter_model.safetensors").read_bytes() == original
    assert main(["demo-assets", "--retrain"]) == 2  # only with --trained
    with pytest.raises(FileNotFoundError, match="--retrain"):
        dt.demo_assets(tmp_path / "nowhere")


def test_lorafleet_demo_prints_every_task_done(capsys):
    assert main(["demo", "--prompt", "dog 3 moon ->"]) == 0
    out = capsys.readouterr().out
    for name, answer in [("base", "dog 3 moon"), ("uppercase", "DOG 3 MOON"),
                         ("reverse", "moon 3 dog"), ("french", "chien 3 lune"),
                         ("digits", "dog three moon"), ("count", "three")]:  # fmt: skip
        assert f"{name:>10} | {answer!r}" in out, out


def test_chat_template_turns_the_last_user_message_into_the_prompt(assets):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    messages = [
        {"role": "system", "content": "ignored"},
        {"role": "user", "content": "cat 7"},
        {"role": "assistant", "content": "cat 7"},
        {"role": "user", "content": "red sun"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "red sun ->"


@pytest.mark.serve
def test_run_command_serves_the_trained_demo_and_shows_every_adapter():
    """`lorafleet up` (the README's run command, configs/serve.yaml) on a Ray it starts: the
    showcase prints each adapter's answer to one prompt, sent together; then SIGTERM during
    traffic stops it within 15 s, every request answered or ended with an error, and
    nothing of Ray's own printed (no token warning at start, no shutdown noise, no
    traceback). Secured (a key from the environment, required on inference too), the
    showcase sends the key and the printed commands read it from the environment.

    Without a key (the same command, its own Ray and deployment: ~40 s more here), `up`
    runs the same steps but for the key: tests/cluster/test_serve_app.py runs `up` on an
    app with none (its printed commands carry no key) and the showcase against it."""
    port = free_port()
    command = [sys.executable, "-m", "cluster.cli", "up", "--port", str(port), "--num-cpus", "2"]
    command += ["--set", "api_key_for_inference=true"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LORAFLEET_API_KEY": "test-key-5566"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    outcomes: list[tuple[float, str]] = []
    traffic: list[threading.Thread] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(".choices[0].text)" in x for x in lines):
            if proc.poll() is not None:
                break  # the command ended early: its output says why
            time.sleep(0.2)
        out = "".join(lines)
        assert "try it" in out and ".choices[0].text)" in out, out[-3000:]
        words = dt.SHOWCASE_PROMPT.removesuffix(" ->").split()
        assert f"requests sent together, prompt {dt.SHOWCASE_PROMPT!r}" in out
        assert f"demo-base | {' '.join(words)!r}" in out, out
        for task, (what, _, answer) in dt.TASKS.items():
            assert f"{task} | {' '.join(answer(words))!r}" in out, out
            assert f"({what})" in out
        # the letters adapter's tool round trip: the call, the function run, the answer
        assert f'{letters.NAME} | calls {letters.TOOL} {{"word": "apple"}}' in out, out
        assert f"here | {letters.TOOL}(word='apple') = 5" in out, out
        assert f"{letters.NAME} | 'apple has five letters'" in out, out
        assert f"http://127.0.0.1:{port}/v1/completions" in out
        assert "Authorization: Bearer $LORAFLEET_API_KEY" in out
        assert "test-key-5566" not in out
        assert f"{sys.executable} -c" in out  # runs as printed in a fresh shell

        url = f"http://127.0.0.1:{port}"
        traffic += [threading.Thread(target=_traffic, args=(url, outcomes)) for _ in range(3)]
        for t in traffic:
            t.start()
        time.sleep(2.0)
        assert outcomes, "no request answered before the stop"
    finally:
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    took = time.monotonic() - stopped
    for t in traffic:
        t.join(timeout=60)
    reader.join(timeout=10)
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    assert took < 15, f"stopped after {took:.1f} s"
    for noise in ("Traceback", "(raylet)", "Token authentication", "Started a local Ray"):
        assert noise not in out, out[-3000:]
    # requests in flight at the stop: answered, or ended with an error (a stream's error
    # event); those sent after it began may be refused or find the server gone
    in_flight = {outcome for began, outcome in outcomes if began < stopped}
    assert in_flight <= {"answered", "error event"}, outcomes
    assert "answered" in in_flight


def _traffic(url: str, outcomes: list[tuple[float, str]]) -> None:
    """Streams, one after another, until the server goes: when each began, how it ended."""
    body = {"model": "uppercase", "prompt": dt.SHOWCASE_PROMPT, "max_tokens": 16, "stream": True}
    headers = {"Authorization": "Bearer test-key-5566"}
    while True:
        began = time.monotonic()
        try:
            with httpx.stream(
                "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=30
            ) as r:
                if r.status_code != 200:
                    outcomes.append((began, "refused"))  # after the stop began: 404 or 503
                    time.sleep(0.05)
                    continue
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
        except httpx.TransportError as e:
            outcomes.append((began, f"connection closed ({type(e).__name__})"))
            if isinstance(e, httpx.ConnectError):
                return  # the server is gone
            continue
        if events and events[-1] == "data: [DONE]" and '"error"' not in "".join(events):
            outcomes.append((began, "answered"))
        elif any('"error"' in e for e in events):
            outcomes.append((began, "error event"))
        else:
            outcomes.append((began, f"cut: {events[-2:]}"))
