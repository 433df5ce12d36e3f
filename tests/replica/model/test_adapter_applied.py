"""An adapter's load names every module it changes with its layer count, so a module left
out (a layer without it) shows in the load's answer and log."""

from __future__ import annotations

import shutil

from safetensors.torch import load_file, save_file

from replica.model.adapter_weights import load_peft_adapter
from replica.model.spec import load_model_spec
from replica.wire import applied_text
from tests.conftest import tiny_assets


def test_applied_counts_each_modules_layers_as_the_file_holds_them(tmp_path):
    tiny = tiny_assets("llama")
    spec = load_model_spec(tiny.model_dir)
    adapter = tmp_path / "partial"
    shutil.copytree(tiny.adapters["adapter-00"], adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    layer0 = [k for k in tensors if ".layers.0." in k]
    module = sorted(layer0)[0].split(".")[-3]  # one module of layer 0 goes
    for key in [k for k in layer0 if f".{module}." in k]:
        del tensors[key]
    save_file(tensors, adapter / "adapter_model.safetensors")
    full = load_peft_adapter(tiny.adapters["adapter-00"], spec, 64, "full").applied()
    partial = load_peft_adapter(adapter, spec, 64, "partial").applied()
    assert set(full) == set(partial) and full[module] == spec.num_layers
    assert partial == {**full, module: spec.num_layers - 1}
    assert f"{module} \u00d7{spec.num_layers - 1}" in applied_text(partial)
