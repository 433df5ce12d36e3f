"""`lorafleet generate` end to end: text in, the engine's tokens out."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest
import yaml

from cluster import ports, serving
from cluster.cli import main
from replica.model.adapter_weights import load_peft_adapter
from replica.model.spec import load_model_spec
from replica.wire import SamplingParams, applied_text
from tests.cluster.cli_runs import SERVE_FAILURE, refused, run_cli
from tests.conftest import tiny_assets
from tests.engines import make_engine
from tests.net import free_port


def test_generate_json_mixed_batch_matches_engine(tiny, capsys):
    loras = [f"--lora={n}={p}" for n, p in tiny.adapters.items()]
    code, out, err = run_cli(
        capsys, "generate", "--model", str(tiny.model_dir), *loras,
        "--prompt", "hello world", "--adapter", "base",
        "--prompt", "the cat sat", "--adapter", "adapter-02",
        "--max-tokens", "8", "--json",
    )  # fmt: skip
    assert code == 0
    # each adapter's load says what it applies, off stdout
    for name, path in tiny.adapters.items():
        applied = load_peft_adapter(path, load_model_spec(tiny.model_dir), 64).applied()
        assert f"adapter {name!r} applies {applied_text(applied)}\n" in err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["adapter"] for r in rows] == [None, "adapter-02"]
    eng = make_engine(tiny, {"adapter-02": tiny.adapters["adapter-02"]})
    for r in rows:
        assert set(r) >= {"prompt_token_ids", "output_token_ids", "text"}
        seq = eng.generate(
            [(r["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=8), r["adapter"])]
        )[0]
        assert r["output_token_ids"] == seq.output_ids
        assert r["finish_reason"] in ("stop", "length")


@pytest.mark.slow
@pytest.mark.ray
def test_generate_with_tp_2_prints_what_tp_1_prints(tiny, capsys):
    """--tp 2: rank 0 in the command's process, rank 1 an actor of the local Ray it starts
    (run as its own process, so that Ray and its rank leave with it)."""
    args = [
        "generate", "--model", str(tiny.model_dir), "--device", "cpu",
        f"--lora=a1={tiny.adapters['adapter-01']}", f"--lora=a3={tiny.adapters['adapter-03']}",
        "--prompt", "hello world", "--adapter", "base",
        "--prompt", "the cat sat", "--adapter", "a1",
        "--prompt", "the cat sat", "--adapter", "a3",
        "--max-tokens", "8", "--json",
    ]  # fmt: skip
    code, single, _ = run_cli(capsys, *args)
    assert code == 0
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args, "--tp", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows == [json.loads(line) for line in single.splitlines()]
    assert len({tuple(r["output_token_ids"]) for r in rows[1:]}) == 2


def test_generate_plain_text_separates_prompt_and_output(tiny, capsys):
    code, out, _ = run_cli(
        capsys, "generate", "--model", str(tiny.model_dir), "--prompt", "hi", "--max-tokens", "4"
    )
    assert code == 0 and out.startswith("[base] prompt: 'hi' | output: '"), out


def test_generate_unknown_adapter_is_a_clear_error(tiny, capsys):
    code, _, err = run_cli(
        capsys, "generate", "--model", str(tiny.model_dir), "--prompt", "hi", "--adapter", "nope"
    )
    assert code == 2
    assert "unknown adapter 'nope'" in err


def test_demo_assets_command(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "demo-assets", "--out", str(tmp_path), "--adapters", "2")
    assert code == 0
    assert (tmp_path / "model" / "config.json").is_file()
    assert out.count("adapter:") == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--model", "/no/such/dir", "--prompt", "hi"], "no config.json"),
        (["generate", "--model", "{tmp}", "--prompt", "hi"], "no config.json"),
        (["generate", "--model", "{model}", "--prompt", "hi", "--lora", "x"], "NAME=PATH"),
        (["generate", "--model", "{model}", "--prompt", "hi", "--lora", "a=/no/such"],
         "is not a directory"),
        (["generate", "--model", "{model}", "--prompt", "a", "--prompt", "b", "--adapter",
          "x", "--adapter", "y", "--adapter", "z"], "3 --adapter values for 2 prompts"),
        (["generate", "--model", "{model}", "--prompt", "hi", "--temperature", "9"],
         "temperature"),
        (["up", "--config", "/no/such.yaml"], "does not exist"),
        (["up", "--address", "auto", "--num-cpus", "2"], "leave it out with --address"),
        (["deploy", "{tmp}/none.yaml"], "does not exist"),
    ],
)  # fmt: skip
def test_user_errors_are_one_line_and_status_2(tiny, tmp_path, capsys, argv, message):
    """What a user can get wrong is one line on stderr and status 2, never a traceback."""
    argv = [a.format(tmp=tmp_path, model=tiny.model_dir) for a in argv]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert message in err and err.startswith("lorafleet: error:"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("command", ["generate", "up", "deploy", "demo-assets", "demo"])
def test_every_command_has_its_help(capsys, command):
    """(An engine setting's description with a "%" once broke `generate --help`.)"""
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0 and f"usage: lorafleet {command}" in capsys.readouterr().out


def test_up_help_names_the_real_default_model(capsys):
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    assert "demo-trained" in capsys.readouterr().out


def test_demo_asset_builds_never_clobber_a_directory(tmp_path, capsys):
    """`--retrain` never replaces the committed trained demo (or any existing --out)
    without --force, and a build never lands in a directory holding something else."""
    code, _, err = run_cli(capsys, "demo-assets", "--trained", "--retrain")
    assert code == 2 and "only with --force" in err and "assets/demo-trained" in err
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for argv in (["--out", str(other)], ["--trained", "--out", str(other)]):
        code, _, err = run_cli(capsys, "demo-assets", *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "give a new --out" in err
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    copy = tmp_path / "copy"
    assert run_cli(capsys, "demo-assets", "--trained", "--out", str(copy))[0] == 0
    assert run_cli(capsys, "demo-assets", "--trained", "--out", str(copy))[0] == 0  # again: fine


def test_help_imports_no_torch_and_no_ray():
    """`lorafleet --help` (and each command's own --help) imports what its flags need:
    neither torch nor Ray for the list of commands, `up`'s or `deploy`'s."""
    code = (
        "import sys\n"
        "from cluster.cli import main\n"
        "for argv in (['--help'], ['up', '--help'], ['deploy', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert "{demo-assets,generate,demo,up,plan,deploy,bench}" in proc.stdout


# -- `lorafleet up` refuses what it can, here, before anything starts --------------------------


def _config_file(tmp_path, edit) -> str:
    config = serving.load_config(serving.DEFAULT_CONFIG)
    edit(config["applications"][0]["args"])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_misspelt_key_is_one_line_naming_its_path(tmp_path, capsys, nothing_starts):
    """`adaptors:` for `adapters:`, in the file or by --set: one line with the field's
    path, not Serve's build retried three times and a traceback."""

    def misspell(args):
        args["store"]["adaptors"] = args["store"].pop("adapters")

    line = refused(capsys, "up", "--config", _config_file(tmp_path, misspell))
    assert line.endswith(
        "applications[0].args.store.adaptors: unknown field (did you mean 'adapters'?)"
    )
    line = refused(capsys, "up", "--set", "adaptors=demo")
    assert "applications[0].args.adaptors: unknown field" in line
    line = refused(capsys, "up", "--set", "engine.adapters.num_slot=4")
    assert (
        "applications[0].args.engine.adapters.num_slot: unknown field (did you mean 'num_slots'?)"
        in line
    )


def test_every_bad_field_gets_its_own_line(tmp_path, capsys, nothing_starts):
    def spoil(args):
        args["routng"] = "affinity"
        args["engine"]["max_lora_rank"] = "big"

    path = _config_file(tmp_path, spoil)
    code, _, err = run_cli(capsys, "up", "--config", path, "--port", str(free_port()))
    assert code == 2
    assert sorted(err.strip().splitlines()) == [
        "lorafleet: error: applications[0].args.engine.max_lora_rank: Input should be a valid "
        "integer, unable to parse string as an integer",
        "lorafleet: error: applications[0].args.routng: unknown field (did you mean 'routing'?)",
    ]


def test_serve_settings_serve_would_ignore_arerefused(tmp_path, capsys, nothing_starts):
    """Serve's own schema ignores unknown keys: a misspelt route_prefix would silently not
    apply."""
    config = serving.load_config(serving.DEFAULT_CONFIG)
    config["applications"][0]["route_prefx"] = "/v2"
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    line = refused(capsys, "up", "--config", str(path))
    assert line.endswith(
        "applications[0].route_prefx: unknown field (did you mean 'route_prefix'?)"
    )


def test_an_unsupported_model_is_one_line_naming_the_cause(tiny, tmp_path, capsys, nothing_starts):
    model = tmp_path / "bert"
    shutil.copytree(tiny.model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    line = refused(capsys, "up", "--model", str(model))
    assert "applications[0].args.engine.model:" in line
    assert "unsupported architecture model_type='bert'" in line
    assert "no config.json" in refused(capsys, "up", "--model", str(tmp_path))
    bare = tmp_path / "bare"  # config and weights, no tokenizer: the Ingress could not start
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny.model_dir / name, bare / name)
    assert f"{bare}: no tokenizer" in refused(capsys, "up", "--model", str(bare))


def test_a_missing_or_bad_adapter_is_one_line_naming_it(tiny, tmp_path, capsys, nothing_starts):
    def missing(args):
        args["store"]["adapters"] = {"support": str(tmp_path / "no-such-adapter")}

    line = refused(capsys, "up", "--model", str(tiny.model_dir), "--config",
                    _config_file(tmp_path, missing))  # fmt: skip
    assert line.endswith(f"applications[0].args.store.adapters.support: {tmp_path}/no-such-adapter "
                         "is not a directory")  # fmt: skip
    assert "is not a directory" in refused(capsys, "up", "--lora", f"x={tmp_path}/none")
    empty = tmp_path / "empty"
    empty.mkdir()
    line = refused(capsys, "up", "--model", str(tiny.model_dir), "--lora", f"x={empty}")
    assert line.endswith(
        f"applications[0].args.store.adapters.x: {empty}: missing adapter_config.json"
    )
    other = tiny_assets("llama", hidden_size=32, num_heads=2, num_kv_heads=1, num_adapters=1)
    line = refused(
        capsys, "up", "--model", str(tiny.model_dir),
        "--lora", f"wrong={other.adapters['adapter-00']}",
    )  # fmt: skip
    assert "applications[0].args.store.adapters.wrong:" in line and "for this base model" in line


def _listening() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def test_up_refuses_a_port_that_accepts_connections(capsys, nothing_starts):
    with _listening() as server:
        port = server.getsockname()[1]
        line = refused(capsys, "up", "--port", str(port), "--no-demo-requests")
    assert f"http://127.0.0.1:{port} already accepts connections" in line


def test_up_refuses_a_port_another_lorafleet_command_is_taking(capsys, nothing_starts):
    """A second `up` started while the first one is still starting (its proxy not
    listening yet) is refused too: the first holds the port's lock until it exits."""
    port = free_port()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         f"from cluster import ports; ports.claim_port('127.0.0.1', {port}); "
         "print('claimed', flush=True); import time; time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "claimed"
        line = refused(capsys, "up", "--port", str(port))
        assert f"port {port} is taken: another lorafleet command" in line
        assert f"pid {holder.pid}" in line
    finally:
        holder.kill()
        holder.wait()
    assert ports.claim_port("127.0.0.1", port)  # free again once its holder is gone
    ports.release_port(port)


def test_local_addresses():
    assert ports.is_local_address(None) and ports.is_local_address("127.0.0.1:6379")
    assert ports.is_local_address("localhost:6379")
    assert ports.is_local_address("ray://127.0.0.1:10001")
    assert not ports.is_local_address("198.51.100.77:6379")  # TEST-NET-2: nobody's


def test_a_failed_deployment_is_reported_by_its_root_cause():
    assert serving.root_cause(SERVE_FAILURE) == (
        "ModelConfigError: /m/config.json: unsupported architecture model_type='bert'; "
        "supported: llama, mistral"
    )
    pydantic_error = (
        'Traceback (most recent call last):\n  File "x.py", line 1\n'
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for AppConfig\n"
        "adaptors\n  Extra inputs are not permitted [type=extra_forbidden]\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/extra_forbidden"
    )
    assert serving.root_cause(pydantic_error) == (
        "ValidationError: 1 validation error for AppConfig adaptors Extra inputs are not "
        "permitted [type=extra_forbidden]"
    )
    assert serving.root_cause("Replica is unhealthy.\nmore") == "Replica is unhealthy."


def test_up_with_tenants_and_no_admin_key_skips_the_showcase(capsys, monkeypatch):
    """Every request needs a tenant's key then, and the config holds only digests: the
    announcement says so instead of a showcase that would end in 401s."""
    from argparse import Namespace

    from cluster import cli

    monkeypatch.delenv("LORAFLEET_API_KEY", raising=False)
    tenant = {"name": "t", "key_sha256": ["0" * 64], "adapters": ["*"]}
    args = {"engine": {"model": "m"}, "ingress": {"tenants": [tenant]}}
    config = {"applications": [{"args": args}]}
    cli._announce(config, Namespace(verbose=True, no_demo_requests=False))
    out = capsys.readouterr().out
    assert "serving at http://127.0.0.1:8000" in out and "no showcase" in out
