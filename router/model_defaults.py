"""The model's own sampling defaults, from its generation_config.json (as vLLM reads it):
what a request that leaves a field unset samples with. Torch-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from replica.wire import SamplingParams

# generation_config.json key -> SamplingParams field
DEFAULT_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """SamplingParams field -> the model's default, for the fields its
    generation_config.json sets ({} without one). Values it sets out of range are left
    out (the API's defaults apply) rather than failing every request."""
    try:
        config = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    defaults = {}
    for key, field in DEFAULT_FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        try:
            SamplingParams(**{field: value})
        except ValueError:
            continue
        defaults[field] = value
    return defaults
