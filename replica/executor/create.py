"""The one place that chooses how a replica holds its model: one rank, or N ranks."""

from __future__ import annotations

import torch

from replica.config import EngineConfig
from replica.executor.base import Executor
from replica.executor.runner import ModelRunner
from replica.model.spec import ModelSpec
from replica.model.tp_layers import TPRank


def create_executor(
    config: EngineConfig, spec: ModelSpec, device: torch.device, dtype: torch.dtype
) -> Executor:
    """A single-rank runner, or with tp_size N rank 0 of a tensor-parallel group (ranks
    1..N-1 are Ray actors that build their shards while rank 0 builds its own)."""

    def runner(rank: TPRank | None = None) -> ModelRunner:
        return ModelRunner(config, spec, device, dtype, rank)

    if config.tp_size == 1:
        return runner()
    # imported here: a group needs Ray, which a one-device engine runs without
    from replica.executor.tp_group import TPExecutor, TPGroup

    group, rank0 = TPGroup.start(config, device, runner)
    return TPExecutor(group, rank0)
