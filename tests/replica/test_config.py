"""EngineConfig's adapters section: the residency knobs nested, the flat keys of the
previous release read with a deprecation line each, and the CLI flags that set them."""

from __future__ import annotations

import argparse
import logging

import pydantic
import pytest

from cluster.engine_args import add_engine_arguments, engine_config_from_args
from replica.config import AdapterResidencyConfig, EngineConfig


def deprecations(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


@pytest.mark.old_config_keys
def test_flat_residency_keys_move_under_adapters_with_a_line_each(caplog):
    caplog.set_level(logging.WARNING)
    old = EngineConfig(model="m", num_slots=4, adapter_loading="sync")
    assert old.adapters == AdapterResidencyConfig(num_slots=4, adapter_loading="sync")
    assert deprecations(caplog) == [
        f"config key engine.{k} is deprecated: write engine.adapters.{k} (the old key goes "
        "next release)"
        for k in ("num_slots", "adapter_loading")
    ]


def test_nested_residency_keys_log_nothing(caplog):
    caplog.set_level(logging.WARNING)
    config = EngineConfig(model="m", adapters={"num_slots": 4, "pin_base_slot": False})
    assert config.adapters.num_slots == 4 and not config.adapters.pin_base_slot
    assert EngineConfig(**config.model_dump()) == config  # what a replica is handed
    assert deprecations(caplog) == []


def test_slots_are_sized_one_way_only():
    with pytest.raises(pydantic.ValidationError, match="not both"):
        EngineConfig(model="m", adapters={"num_slots": 4, "adapter_memory_bytes": 1 << 20})


def test_with_adapters_changes_only_the_adapters_section():
    config = EngineConfig(model="m", max_num_seqs=8, adapters={"prefetch_window": 3})
    sized = config.with_adapters(num_slots=5)
    assert sized.adapters == AdapterResidencyConfig(prefetch_window=3, num_slots=5)
    assert sized.model_copy(update={"adapters": config.adapters}) == config


def test_engine_flags_set_the_adapters_section_by_their_plain_names():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, skip={"model"})
    args = parser.parse_args(["--num-slots", "3", "--max-num-seqs", "8", "--tp", "1"])
    config = engine_config_from_args(args, model="m", adapters={"prefetch_window": 2})
    assert config.adapters == AdapterResidencyConfig(num_slots=3, prefetch_window=2)
    assert config.max_num_seqs == 8
