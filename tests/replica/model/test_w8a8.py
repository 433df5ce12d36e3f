"""W8A8: an FP8 checkpoint made for dynamic per-token activation scales runs its GEMMs on FP8
activations where a GPU has FP8 tensor cores, and W8A16 (exact to its dequantization)
everywhere else. What decides it, from config.json to each packed weight, checked on CPU;
the CUDA run itself is tests/kernels/test_quant.py's act_fp8 test on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import Fp8Weight, dequantize
from kernels.quant_pack import quantize_fp8
from replica.model import quant_weights
from replica.model.decoder import CausalLM
from replica.model.quant_config import quant_scheme
from replica.model.quant_weights import PackedLinear, runs_w8a8, slice_cols, slice_rows
from replica.model.spec import load_model_spec
from tests.conftest import tiny_assets
from tests.quant_checkpoints import FORMATS, quantize_dir


def _format(quant: dict):
    return quant_scheme({"quantization_config": quant}, "config.json").groups[0][1]


@pytest.mark.parametrize(
    "fmt, dynamic",
    [("fp8-block", True), ("ct-fp8-channel", True), ("ct-fp8-tensor-static", False)],
)
def test_the_checkpoint_says_whether_activations_are_quantized_per_token(fmt, dynamic):
    quant = FORMATS[fmt][1]([])
    assert _format(quant).act_fp8 is dynamic
    if fmt == "fp8-block":  # Qwen's static scheme ships activation scales: W8A16 here
        assert _format({**quant, "activation_scheme": "static"}).act_fp8 is False


def test_w8a8_runs_only_on_fp8_tensor_cores_with_whole_blocks_per_tile(monkeypatch):
    monkeypatch.setattr(quant_weights, "_fp8_tensor_cores", lambda index: index == 0)
    w = quantize_fp8(torch.randn(256, 256), (128, 128))
    dynamic = Fp8Weight(w.weight, w.scale, w.block, dynamic_activations=True)
    sm90, sm80 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert runs_w8a8(dynamic, sm90)
    assert not runs_w8a8(dynamic, sm80) and not runs_w8a8(dynamic, torch.device("cpu"))
    assert not runs_w8a8(w, sm90)  # a W8A16 checkpoint stays W8A16
    odd = quantize_fp8(torch.randn(8, 96), (8, 32))  # a 64-column tile would cut a block
    assert not runs_w8a8(Fp8Weight(odd.weight, odd.scale, odd.block, True), sm90)


def test_a_ranks_share_keeps_the_activation_scheme():
    w = quantize_fp8(torch.randn(256, 256), (128, 128))
    dynamic = Fp8Weight(w.weight, w.scale, w.block, dynamic_activations=True)
    assert slice_rows(dynamic, 0, 128).dynamic_activations
    assert slice_cols(dynamic, 128, 256).dynamic_activations


def test_a_dynamic_checkpoint_loads_so_and_stays_exact_on_cpu(tmp_path):
    src = tiny_assets("llama").model_dir
    model_dir = tmp_path / "fp8"
    quantize_dir(src, model_dir, "fp8-block")
    model = CausalLM(model_dir, "cpu", torch.float32, spec=load_model_spec(model_dir))
    qkv = model.layers[0].qkv_proj.weight
    assert isinstance(qkv, PackedLinear)
    assert all(isinstance(p, Fp8Weight) and p.dynamic_activations for p in qkv.parts)
    x = torch.randn(5, qkv.parts[0].shape[1])
    want = torch.cat([x @ dequantize(p).T for p in qkv.parts], dim=1)
    torch.testing.assert_close(qkv(x), want, rtol=1e-5, atol=1e-5)  # W8A16 on the CPU
