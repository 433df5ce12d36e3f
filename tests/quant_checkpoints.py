"""Quantized copies of a dense Hugging Face model directory, written in the layouts the Hub
and llm-compressor publish (config.json's quantization_config and every tensor's name,
dtype and shape), with kernels.quant_pack's packers (each checked against the format's own
tooling by tests/kernels/test_quant_formats.py), and the dense directory of the same
weights dequantized: the oracle transformers loads where its quantizer needs a GPU or a
library not installed here.

FORMATS names each layout; `quantize_dir(src, out, fmt, dense=...)` writes it, the modules
listed in `dense` left unquantized and named in the config's ignore list;
`quantize_gemma4` does so with Gemma 4's MoE experts un-fused per expert first
(llm-compressor's layout); `mxfp4_copy` writes gpt-oss's experts as the Hub ships them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kernels import dequantize
from kernels.quant_formats import E2M1_VALUES
from kernels.quant_pack import (
    nf4_absmax,
    pack_awq,
    pack_gptq,
    pack_quantized,
    quantize_fp8,
    quantize_int4,
    quantize_nf4,
)
from tests.model_dirs import PUBLISHED

# config.json of openai/gpt-oss-20b as the Hub ships it (MXFP4 experts)
GPT_OSS_20B = json.loads((PUBLISHED / "gpt-oss-20b" / "config.json").read_text())
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}  # fmt: skip


def _ct_config(fmt: str, weights: dict, dense: list[str], activations: dict | None) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": activations}},
        "ignore": ["lm_head", *dense], "kv_cache_scheme": None,
    }  # fmt: skip


def _ct_fp8(strategy: str, static: bool):
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
               "dynamic": False, "group_size": None, "actorder": None}  # fmt: skip
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
            "strategy": "tensor" if static else "token"}  # fmt: skip
    block = (1, None) if strategy == "channel" else None

    def write(name: str, w: torch.Tensor, out: dict, dense: list[str]):
        n, k = w.shape
        q = quantize_fp8(w, None if block is None else (1, k))
        out[f"{name}.weight"] = q.weight
        scale = q.scale.to(torch.bfloat16)  # llm-compressor keeps scales in the model's dtype
        out[f"{name}.weight_scale"] = scale if strategy == "channel" else scale.reshape(1)
        if static:
            out[f"{name}.input_scale"] = torch.tensor([0.02], dtype=torch.bfloat16)
        return type(q)(q.weight, scale.float().reshape(q.scale.shape), q.block)

    return write, lambda dense: _ct_config("float-quantized", weights, dense, acts)


def _ct_int4(group: int | None, symmetric: bool):
    strategy = "channel" if group is None else "group"
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": group, "dynamic": False, "actorder": None}  # fmt: skip

    def write(name: str, w: torch.Tensor, out: dict, dense: list[str]):
        n, k = w.shape
        g = group or k
        groups = torch.arange(k) // g
        codes, scales, zeros = quantize_int4(w, groups, -(-k // g), symmetric)
        q = pack_quantized(codes, scales, None if symmetric else zeros, g)
        out[f"{name}.weight_packed"] = q.weight_packed
        out[f"{name}.weight_scale"] = q.weight_scale
        out[f"{name}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        if not symmetric:
            out[f"{name}.weight_zero_point"] = q.weight_zero_point
        return q

    return write, lambda dense: _ct_config("pack-quantized", weights, dense, None)


def _gptq(group: int, desc_act: bool):
    def write(name: str, w: torch.Tensor, out: dict, dense: list[str]):
        n, k = w.shape
        groups = torch.arange(k) // group
        if desc_act:  # act-order: columns quantized in a permuted order, g_idx maps them
            perm = torch.randperm(k, generator=torch.Generator().manual_seed(len(name)))
            groups = groups[torch.argsort(perm)]
        codes, scales, zeros = quantize_int4(w, groups, -(-k // group), symmetric=True)
        q = pack_gptq(codes, scales, zeros, group, groups if desc_act else None)
        out |= {f"{name}.qweight": q.qweight, f"{name}.qzeros": q.qzeros,
                f"{name}.scales": q.scales, f"{name}.g_idx": groups.to(torch.int32)}  # fmt: skip
        return q

    def config(dense: list[str]) -> dict:
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
                "sym": True, "checkpoint_format": "gptq", "damp_percent": 0.01,
                "modules_to_not_convert": dense or None}  # fmt: skip

    return write, config


def _awq(group: int):
    def write(name: str, w: torch.Tensor, out: dict, dense: list[str]):
        k = w.shape[1]
        codes, scales, zeros = quantize_int4(w, torch.arange(k) // group, k // group, False)
        q = pack_awq(codes, scales, zeros, group)
        out |= {f"{name}.qweight": q.qweight, f"{name}.qzeros": q.qzeros,
                f"{name}.scales": q.scales}  # fmt: skip
        return q

    def config(dense: list[str]) -> dict:
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                "zero_point": True, "modules_to_not_convert": dense or None}  # fmt: skip

    return write, config


def _bnb_nf4(nested: bool):
    """bitsandbytes' serialized Params4bit. Double quantization (`nested`): the absmax less
    its mean, 8-bit codes per 256 blocks over a table the checkpoint carries (bitsandbytes'
    dynamic map; any table reads the same way, here a uniform one)."""

    def write(name: str, w: torch.Tensor, out: dict, dense: list[str]):
        n, k = w.shape
        q = quantize_nf4(w)
        key = f"{name}.weight"
        state = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [n, k]}
        out |= {key: q.packed.view(-1, 1), f"{key}.quant_map": q.code}
        absmax = q.absmax
        if nested:
            offset = absmax.mean()
            table = torch.linspace(-1, 1, 256)
            blocks = absmax - offset
            padded = torch.zeros(-(-blocks.numel() // 256) * 256)
            padded[: blocks.numel()] = blocks
            scale = padded.view(-1, 256).abs().amax(dim=1).clamp(min=1e-12)
            codes = (blocks[:, None] / scale.repeat_interleave(256)[: blocks.numel(), None]
                     - table).abs().argmin(dim=1).to(torch.uint8)  # fmt: skip
            out |= {f"{key}.absmax": codes, f"{key}.nested_absmax": scale,
                    f"{key}.nested_quant_map": table}  # fmt: skip
            state |= {"nested_blocksize": 256, "nested_offset": offset.item(),
                      "nested_dtype": "float32"}  # fmt: skip
            absmax = nf4_absmax(codes, scale, table, offset.item(), 256)
        else:
            out[f"{key}.absmax"] = absmax
        blob = list(json.dumps(state).encode())
        out[f"{key}.quant_state.bitsandbytes__nf4"] = torch.tensor(blob, dtype=torch.uint8)
        return type(q)(q.packed, absmax, q.code, q.shape, q.blocksize)

    def config(dense: list[str]) -> dict:
        return {"quant_method": "bitsandbytes", "_load_in_4bit": True, "load_in_4bit": True,
                "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
                "bnb_4bit_use_double_quant": nested, "bnb_4bit_compute_dtype": "float32",
                "llm_int8_skip_modules": dense or None}  # fmt: skip

    return write, config


def _fp8_block(name: str, w: torch.Tensor, out: dict, dense: list[str]):
    q = quantize_fp8(w, (128, 128))
    out[f"{name}.weight"], out[f"{name}.weight_scale_inv"] = q.weight, q.scale
    return q


FORMATS = {
    "fp8-block": (_fp8_block, lambda dense: FP8_BLOCK | {"modules_to_not_convert": dense or None}),
    "ct-fp8-channel": _ct_fp8("channel", static=False),
    "ct-fp8-tensor-static": _ct_fp8("tensor", static=True),
    "ct-w4a16-g16": _ct_int4(16, symmetric=True),
    "ct-w4a16-asym-g32": _ct_int4(32, symmetric=False),
    "ct-w4a16-channel": _ct_int4(None, symmetric=True),
    "gptq-g32": _gptq(32, desc_act=False),
    "gptq-g16-desc-act": _gptq(16, desc_act=True),
    "awq-g32": _awq(32),
    "bnb-nf4": _bnb_nf4(nested=False),
    "bnb-nf4-nested": _bnb_nf4(nested=True),
}


# The decoder layers' Linear weights a quantizer targets: every *_proj, a Gated DeltaNet's
# in_proj_qkv / _z / _b / _a, Gemma 4's per-layer-input gate and projection
LINEAR = re.compile(r"(_proj|\.in_proj_\w+|\.per_layer_input_gate|\.per_layer_projection)\.weight$")


def quantize_dir(src: Path, out: Path, fmt: str, dense: tuple[str, ...] = ()) -> Path:
    """Write `src` quantized as `fmt` to `out` (every LINEAR weight of the decoder layers,
    but the module paths in `dense`), and `out`-dense: the same weights dequantized, in float32.
    Returns the dense directory."""
    write, config = FORMATS[fmt]
    oracle = out.with_name(out.name + "-dense")
    for d in (out, oracle):
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src, d)
    tensors = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for key, w in tensors.items():
        name = key.removesuffix(".weight")
        if not (LINEAR.search(key) and ".layers." in key) or name in dense:
            quantized[key] = dequantized[key] = w
            continue
        dequantized[key] = dequantize(write(name, w, quantized, list(dense)))
    quantized = {k: t.contiguous() for k, t in quantized.items()}
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, oracle / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = config(list(dense))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return oracle


PLE = "model.per_layer_model_projection"  # Gemma 4's, whole on every rank


def quantize_gemma4(src: Path, model_dir: Path, fmt: str, ple: bool) -> Path:
    """quantize_dir for Gemma 4, its MoE experts un-fused per expert first (then packed
    like the rest) and, with `ple`, per_layer_model_projection packed too. Returns the
    dense oracle, its experts stacked back as transformers reads them."""
    unfused = model_dir.with_name(model_dir.name + "-src")
    shutil.rmtree(unfused, ignore_errors=True)
    shutil.copytree(src, unfused)
    tensors = load_file(src / "model.safetensors")
    for key in [k for k in tensors if k.endswith(".experts.gate_up_proj")]:
        where = key.removesuffix(".gate_up_proj")
        gate_up, down = tensors.pop(key), tensors.pop(f"{where}.down_proj")
        gate, up = gate_up.chunk(2, dim=1)  # [E, I, hidden] each
        for e in range(gate_up.shape[0]):
            tensors[f"{where}.{e}.gate_proj.weight"] = gate[e].contiguous()
            tensors[f"{where}.{e}.up_proj.weight"] = up[e].contiguous()
            tensors[f"{where}.{e}.down_proj.weight"] = down[e].contiguous()
    save_file(tensors, unfused / "model.safetensors", metadata={"format": "pt"})
    oracle = quantize_dir(unfused, model_dir, fmt, () if ple else (PLE,))  # else: ignored
    packed, dense = (load_file(d / "model.safetensors") for d in (model_dir, oracle))
    if ple:
        write, config = FORMATS[fmt]
        w = packed.pop(f"{PLE}.weight")
        dense[f"{PLE}.weight"] = dequantize(write(PLE, w, packed, []))
        save_file(packed, model_dir / "model.safetensors", metadata={"format": "pt"})
    for key in [k for k in dense if k.endswith(".experts.0.gate_proj.weight")]:
        where = key.removesuffix(".0.gate_proj.weight")
        e = sum(k.startswith(f"{where}.") and k.endswith(".gate_proj.weight") for k in dense)
        proj = {m: [dense.pop(f"{where}.{j}.{m}.weight") for j in range(e)]
                for m in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
        dense[f"{where}.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(proj["gate_proj"], proj["up_proj"])]
        )
        dense[f"{where}.down_proj"] = torch.stack(proj["down_proj"])
    save_file(dense, oracle / "model.safetensors", metadata={"format": "pt"})
    shutil.rmtree(unfused)
    return oracle


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] fp32 -> OCP MXFP4 as gpt-oss ships it: blocks [E, N, K/32, 16] uint8
    (element 2j in the low nibble) and e8m0 scales [E, N, K/32] uint8, each 32-group's
    exponent the smallest that fits its largest value in e2m1's 6, values rounded to the
    nearest e2m1."""
    e, n, k = w.shape
    groups = w.reshape(e, n, k // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2**-100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)
    code |= ((scaled < 0) & (code > 0)).long() << 3
    pairs = code.to(torch.uint8).reshape(e, n, k // 32, 16, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), (exp + 127).to(torch.uint8)


def mxfp4_copy(model_dir: Path, out: Path) -> Path:
    """The model with its experts in the Hub's MXFP4 layout: gate_up_proj [E, H, 2I] as
    gate_up_proj_blocks / _scales over [E, 2I, H] (out, in), down_proj likewise; biases,
    attention and router unquantized, as in openai/gpt-oss-20b."""
    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = to_mxfp4(tensors.pop(key).transpose(1, 2).contiguous())
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = GPT_OSS_20B["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out
