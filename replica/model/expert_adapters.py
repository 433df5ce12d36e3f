"""Expert LoRA in a PEFT adapter file: both layouts, told apart by their keys, no flag.

- Per-expert 2D modules (PEFT on transformers 4, where each expert is an nn.Linear):
  `…layers.L.<block>.experts.E.<proj>.lora_A.weight` [r, in] and `lora_B` [out, r], with
  <block> `mlp` or Mixtral's `block_sparse_moe` and <proj> the family's names
  (gate_proj/up_proj/down_proj, Mixtral's w1/w3/w2). Each expert is its own module for
  rank_pattern / alpha_pattern (`model.layers.L.mlp.experts.E.gate_proj`).
- PEFT `target_parameters` on transformers 5's stacked experts (ParamWrapper, PEFT >=
  0.18): `…layers.L.mlp.experts[.base_layer]*.lora_A.weight` [E·r, in] and `lora_B`
  [out, E·r], one pair per targeted parameter (gate_up_proj: in hidden, out 2·I, gate
  rows then up rows, or on gpt-oss interleaved, gate j at row 2j and up j at 2j+1, as
  its gate_up_proj's columns are; down_proj: in I, out hidden), nested wrappers adding
  `.base_layer`.
  Expert e's A is rows [e·r, (e+1)·r) of lora_A; its B is columns e, e+E, e+2E, ... of
  lora_B (PEFT reshapes B to [out, r, E]). Which parameter a pair adapts is read from
  its shapes (gate_up and down cannot share both shapes), patterns match
  `model.layers.L.mlp.experts.gate_up_proj` / `…down_proj`.

Either way each expert's delta is scaling · B_e A_e on its gate / up / down rows: the
same 2D (A [r, in], B [out, r]) per (layer, projection, expert) that the converter pads,
scales and stacks ([E, r, in], [E, out, r]) under the modules expert_gate_proj,
expert_up_proj, expert_down_proj. A key that names experts in any other shape is
refused, saying what was found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from replica.model.peft_config import AdapterFormatError
from replica.model.spec import ModelSpec

EXPERT_MODULES = ("expert_gate_proj", "expert_up_proj", "expert_down_proj")
# the experts' module path: model.layers.L.<block>.experts, Gemma 4's without a block
# (model.layers.L.experts, or model.language_model.layers.L.experts in its wrapper)
_PREFIX = (
    r"^base_model\.model\.(model\.(?:language_model\.)?layers\.(\d+)\."
    r"(?:(?:mlp|block_sparse_moe)\.)?experts)\."
)
_KEY_2D = re.compile(_PREFIX + r"(\d+)\.(\w+)\.lora_([AB])\.weight$")
_KEY_3D = re.compile(_PREFIX + r"((?:base_layer\.)*)lora_([AB])\.weight$")
_ANY_EXPERT = re.compile(r"\.experts\.")


@dataclass
class ExpertPart:
    """One expert's LoRA on one projection, as PEFT holds it."""

    layer: int
    module: str  # one of EXPERT_MODULES
    expert: int
    path: str  # the module name PEFT's rank / alpha patterns match
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]


def is_expert_key(key: str) -> bool:
    return bool(_ANY_EXPERT.search(key))


def expert_parts(name: str, tensors: dict[str, torch.Tensor], spec: ModelSpec) -> list[ExpertPart]:
    """Every expert LoRA tensor of `tensors` (keys is_expert_key) as ExpertParts."""
    if not spec.num_experts:
        key = next(iter(tensors))
        raise AdapterFormatError(
            f"{name}: tensor {key!r} is expert LoRA, but model_type={spec.arch!r} has no experts"
        )
    flat: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    stacked: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m2, m3 = _KEY_2D.match(key), _KEY_3D.match(key)
        if m2 is not None:
            stem, layer, expert, proj, which = m2.groups()
            flat.setdefault((int(layer), f"{stem}.{expert}", proj), {})[which] = tensor
        elif m3 is not None:
            stem, layer, depth, which = m3.groups()
            stacked.setdefault((int(layer), stem, depth), {})[which] = tensor
        else:
            raise AdapterFormatError(
                f"{name}: tensor {key!r} {tuple(tensor.shape)} is expert LoRA in a layout this "
                "server cannot read (it reads per-expert keys …experts.<e>.<projection>"
                ".lora_A.weight and PEFT target_parameters keys …experts[.base_layer]"
                ".lora_A.weight)"
            )
    for layer, _where, _proj in flat:
        _check_layer(name, layer, spec)
    parts = [p for key, ab in flat.items() for p in _from_2d(name, key, ab, spec)]
    for (layer, stem, depth), ab in stacked.items():
        _check_layer(name, layer, spec)
        parts += _from_3d(name, layer, stem, depth, ab, spec)
    seen: set[tuple[int, str, int]] = set()
    for p in parts:
        if (p.layer, p.module, p.expert) in seen:
            raise AdapterFormatError(
                f"{name}: layer {p.layer} expert {p.expert} {p.module[7:]} has LoRA twice "
                "(per-expert keys and target_parameters on the same projection)"
            )
        seen.add((p.layer, p.module, p.expert))
    return parts


def _from_2d(
    name: str, key: tuple[int, str, str], ab: dict[str, torch.Tensor], spec: ModelSpec
) -> list[ExpertPart]:
    layer, where, proj = key
    expert = int(where.rsplit(".", 1)[1])
    if proj not in spec.expert_names:
        raise AdapterFormatError(
            f"{name}: layer {layer} {where}.{proj}: an expert of model_type={spec.arch!r} "
            f"has projections {', '.join(spec.expert_names)}"
        )
    if expert >= spec.num_experts:
        raise AdapterFormatError(
            f"{name}: layer {layer} {where}.{proj}: expert {expert}, the model has "
            f"{spec.num_experts}"
        )
    a, b = _pair(name, f"layer {layer} {where}.{proj}", ab)
    module = EXPERT_MODULES[spec.expert_names.index(proj)]
    path = f"{where}.{proj}"
    return [ExpertPart(layer, module, expert, path, a, b)]


def _from_3d(
    name: str, layer: int, stem: str, depth: str, ab: dict[str, torch.Tensor], spec: ModelSpec
) -> list[ExpertPart]:
    where = f"{stem}.{depth}"
    a, b = _pair(name, f"layer {layer} {where}", ab)
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] % e:
        raise AdapterFormatError(
            f"{name}: layer {layer} {where} target_parameters LoRA: lora_A {tuple(a.shape)} / "
            f"lora_B {tuple(b.shape)}, expected [E·r, in] / [out, E·r] with E={e} experts"
        )
    if (a.shape[1], b.shape[0]) == (h, 2 * i):
        param, modules = "gate_up_proj", ("expert_gate_proj", "expert_up_proj")
    elif (a.shape[1], b.shape[0]) == (i, h):
        param, modules = "down_proj", ("expert_down_proj",)
    else:
        raise AdapterFormatError(
            f"{name}: layer {layer} {where} target_parameters LoRA: lora_A {tuple(a.shape)} / "
            f"lora_B {tuple(b.shape)} fit neither the experts' gate_up_proj ([E·r, {h}] / "
            f"[{2 * i}, E·r]) nor their down_proj ([E·r, {i}] / [{h}, E·r])"
        )
    r = a.shape[0] // e
    a_e = a.reshape(e, r, a.shape[1])  # expert-major rows
    b_e = b.reshape(b.shape[0], r, e)  # rank-major columns: expert e's are e, e+E, ...
    path = f"{stem}.{param}"
    interleaved = spec.expert_layout == "gpt_oss"
    parts = []
    for expert in range(e):
        rows = b_e[:, :, expert]
        for j, module in enumerate(modules):  # gate rows, then up rows (or interleaved)
            if len(modules) == 1:
                part = rows
            else:
                part = rows[j::2] if interleaved else rows[j * i : (j + 1) * i]
            parts.append(ExpertPart(layer, module, expert, path, a_e[expert], part))
    return parts


def _pair(name: str, where: str, ab: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if set(ab) != {"A", "B"}:
        missing = ({"A", "B"} - set(ab)).pop()
        raise AdapterFormatError(f"{name}: {where} lacks lora_{missing}")
    return ab["A"], ab["B"]


def _check_layer(name: str, layer: int, spec: ModelSpec) -> None:
    if layer >= spec.num_layers or not spec.is_sparse(layer):
        what = "past the model's" if layer >= spec.num_layers else "a dense layer"
        raise AdapterFormatError(f"{name}: expert LoRA on layer {layer}: {what}")


def stack_experts(
    parts: dict[int, tuple[torch.Tensor, torch.Tensor]], num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert (A [r_e, in], B [out, r_e]) -> (A [E, r, in], B [E, out, r]) at the
    largest r_e; a smaller expert's rows past its rank, and experts the adapter leaves
    out, are zeros (they add nothing to B·A)."""
    r = max(a.shape[0] for a, _ in parts.values())
    a0, b0 = next(iter(parts.values()))
    a = a0.new_zeros(num_experts, r, a0.shape[1])
    b = b0.new_zeros(num_experts, b0.shape[0], r)
    for e, (a_e, b_e) in parts.items():
        a[e, : a_e.shape[0]], b[e, :, : b_e.shape[1]] = a_e, b_e
    return a, b
