"""generation_config.json's end-of-turn ids end generation (Llama-3 Instruct keeps
<|eot_id|> only there)."""

from __future__ import annotations

import json
import shutil

from replica.model.spec import load_model_spec


def test_generation_config_eos_ids_join_the_models(tiny, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny.model_dir, model)
    base = load_model_spec(model).eos_token_ids
    assert base and 77 not in base
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [base[0], 77]}))
    assert load_model_spec(model).eos_token_ids == (*base, 77)
    (model / "generation_config.json").write_text("{broken")
    assert load_model_spec(model).eos_token_ids == base
