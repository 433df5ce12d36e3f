"""A replica computes on the CPUs Ray gave it: no more (replicas sharing a node would
oversubscribe it), no fewer (a replica given two cores used one)."""

from __future__ import annotations

import pytest
import ray
import torch

from replica.serve import deployment


@pytest.mark.parametrize("assigned, threads", [(2.0, 2), (4.0, 4), (0.5, 1), (None, 1)])
def test_compute_threads_follow_the_assigned_cpus(monkeypatch, assigned, threads):
    class Context:
        def get_assigned_resources(self) -> dict:
            return {} if assigned is None else {"CPU": assigned}

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    before = torch.get_num_threads()
    try:
        assert deployment._use_assigned_cpus() == threads
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
