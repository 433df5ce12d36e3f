"""Tensor-parallel ranks on distinct GPUs: a Ray the group starts is not shown rank 0's
GPU, and a group whose ranks report one GPU's UUID twice is refused before it forms.
CUDA and Ray are stand-ins here (tests/replica/fake_cuda.py, recorded ray.init)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import ray
import torch

from replica.executor import tp_group
from replica.executor.tp_group import TPGroup, TPRankError, check_distinct_devices


@pytest.fixture
def ray_starts(monkeypatch) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES as each ray.init saw it (the Ray it starts inherits it)."""
    seen: list[str | None] = []
    monkeypatch.setattr(
        ray, "init", lambda **kw: seen.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
    )
    return seen


def test_a_ray_started_for_the_ranks_is_not_shown_rank_0s_gpu(fake_cuda, ray_starts):
    """Ray hands an actor the first GPU it counts as free: rank 0's, computing outside
    Ray's accounting, would be the first. Started without it, Ray cannot hand it out."""
    fake_cuda.count = 4
    tp_group._start_ray(torch.device("cuda", 1), 4)
    assert ray_starts == ["0,2,3"] and "CUDA_VISIBLE_DEVICES" not in os.environ


def test_rank_0s_gpu_is_hidden_as_cuda_visible_devices_names_it(fake_cuda, ray_starts, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b,GPU-c")
    fake_cuda.count = 3
    tp_group._start_ray(torch.device("cuda", 0), 2)
    assert (
        ray_starts == ["GPU-b,GPU-c"] and os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b,GPU-c"
    )


def test_too_few_gpus_for_the_ranks_is_refused_before_ray_starts(fake_cuda, ray_starts):
    with pytest.raises(
        ValueError, match="tp_size=3 needs 3 GPUs, one per rank; this process sees 2"
    ):
        tp_group._start_ray(torch.device("cuda", 0), 3)
    assert ray_starts == []


def test_a_cpu_group_starts_ray_as_it_is(ray_starts):
    tp_group._start_ray(torch.device("cpu"), 2)
    assert ray_starts == [os.environ.get("CUDA_VISIBLE_DEVICES")]


def test_two_ranks_on_one_gpu_are_named():
    check_distinct_devices(["GPU-a", "GPU-b", "GPU-c"])
    check_distinct_devices([None, None])  # CPU ranks share the CPU
    with pytest.raises(
        TPRankError, match=r"^tensor-parallel ranks 0 and 2 are on one GPU \(GPU-a\)"
    ):
        check_distinct_devices(["GPU-a", "GPU-b", "GPU-a"])


class _Rank:
    """A rank actor's handle whose ready() reports a GPU; joining is a test failure."""

    def __init__(self, gpu: str) -> None:
        self.ready = SimpleNamespace(remote=lambda: {"pid": 1, "device": gpu})
        self.join = SimpleNamespace(remote=self._join)

    def _join(self, *args):
        raise AssertionError("the group formed")


def test_a_group_with_two_ranks_on_one_gpu_is_refused_before_it_forms(fake_cuda, monkeypatch):
    """Rank 0 on cuda:1 (uuid-1); rank 2 was given that GPU too."""
    group = object.__new__(TPGroup)
    group._device = torch.device("cuda", 1)
    group.workers = [_Rank("GPU-uuid-0"), _Rank("GPU-uuid-1")]
    group.rank = SimpleNamespace(comm=SimpleNamespace(listen=group.workers[0]._join))
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    with pytest.raises(TPRankError, match="ranks 0 and 2 are on one GPU \\(GPU-uuid-1\\)"):
        group._connect()
