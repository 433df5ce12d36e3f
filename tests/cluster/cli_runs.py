"""`lorafleet` commands run in the test's process (cluster.cli.main), and what they print."""

from __future__ import annotations

from unittest import mock

import ray

from cluster.cli import main
from tests.net import free_port


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Return (exit status, stdout, stderr) of `lorafleet ARGV` run in this process."""
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(capsys, *argv: str) -> str:
    """Return the one line `lorafleet ARGV` (run in this process) writes on stderr, after
    checking it exits with status 2, with no traceback, before any Ray starts.

    A refusal comes before anything starts: ray.init raises here, so a check that ran
    after a cluster came up fails the test instead of passing slowly. An `up` without
    --port gets a free one (not 8000: a server of someone's may hold it)."""
    if argv[0] == "up" and "--port" not in argv:
        argv = (*argv, "--port", str(free_port()))
    started_ray = AssertionError(f"lorafleet {' '.join(argv)} started Ray before refusing")
    with mock.patch.object(ray, "init", side_effect=started_ray):
        code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lorafleet: error: "), err
    assert "Traceback" not in err
    return lines[0]


SERVE_FAILURE = (  # a Serve deployment status message, as Ray 2.60 writes it (shortened)
    "The deployment failed to start 3 times in a row. This may be due to a problem with its "
    "constructor or initial health check failing. See controller logs for details. Error:\n"
    "\x1b[36mray::ServeReplica:lorafleet:AdapterStore.initialize_and_get_metadata()\x1b[39m "
    "(pid=14933, ip=192.0.2.2)\n"
    '  File "/ray/serve/_private/replica.py", line 1928, in initialize\n'
    "    raise RuntimeError(traceback.format_exc()) from None\n"
    "RuntimeError: Traceback (most recent call last):\n"
    '  File "/work/main/cluster/adapter_store.py", line 116, in __init__\n'
    "    self.spec = load_model_spec(model)\n"
    "replica.model.hf_config.ModelConfigError: /m/config.json: unsupported architecture "
    "model_type='bert'; supported: llama, mistral"
)
