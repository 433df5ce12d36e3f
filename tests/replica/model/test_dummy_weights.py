"""engine.load_format "dummy": a model built from config.json alone, random weights made
on the device, no weight file read."""

from __future__ import annotations

import pytest
import torch

from cluster.demo.families import FAMILY_CONFIGS, family_model_dir
from kernels import Mxfp4Weight
from replica.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.executor.memory_plan import weight_bytes
from replica.model.decoder import CausalLM
from replica.model.weights import DUMMY_E8M0, DummyCheckpoint, open_checkpoint
from replica.wire import SamplingParams
from tests.engines import held_bytes
from tests.model_dirs import config_only

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_a_dummy_engine_generates_from_config_and_tokenizer_alone(tiny, tmp_path):
    model_dir = config_only(tiny.model_dir, tmp_path / "model")
    assert not list(model_dir.glob("*.safetensors"))
    cfg = EngineConfig(
        model=str(model_dir), device="cpu", load_format="dummy", adapters={"num_slots": 2}
    )
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    runs = []
    for _ in range(2):
        eng = LLMEngine(cfg)
        seqs = eng.generate([(p, GREEDY, None) for p in prompts])
        runs.append([s.output_ids for s in seqs])
        assert all(len(s.output_ids) == 6 for s in seqs)
        assert all(0 <= t < eng.spec.vocab_size for s in seqs for t in s.output_ids)
        eng.shutdown()
    assert runs[0] == runs[1]  # seeded: the same weights, the same tokens
    # without load_format dummy the same directory is refused: it has no weights
    with pytest.raises(ValueError, match="no model.safetensors"):
        LLMEngine(cfg.model_copy(update={"load_format": "auto"}))


def test_dummy_weights_stay_finite_in_bf16_at_depth(tiny, tmp_path):
    """48 layers in bf16: the residual stream and the logits stay finite."""
    model_dir = config_only(tiny.model_dir, tmp_path / "deep", num_hidden_layers=48)
    eng = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="bfloat16",
            load_format="dummy",
            adapters={"num_slots": 2},
        )
    )
    logits = eng.score(list(range(3, 40)))
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.std().item() < 100


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_every_family_builds_from_its_config_alone(family, tmp_path):
    model_dir = config_only(family_model_dir(family), tmp_path / family)
    model = CausalLM(model_dir, CPU, torch.float32, load_format="dummy")
    # norms are the identity, whether stored as w (Llama) or as w of 1+w (Gemma)
    assert torch.all(model.layers[0].input_norm.weight == 1.0)


def test_a_rank_part_is_the_slice_of_the_whole_tensor():
    """Tensor-parallel ranks draw the same whole tensor and keep their part: TP=N holds
    TP=1's weights."""
    ckpt = DummyCheckpoint("m", CPU, torch.float32)
    whole = ckpt.get("model.layers.0.self_attn.q_proj.weight", (8, 6))
    assert torch.equal(ckpt.get_part("model.layers.0.self_attn.q_proj.weight", (8, 6), 0, 2, 5),
                       whole[2:5])  # fmt: skip
    assert torch.equal(ckpt.get_part("model.layers.0.self_attn.q_proj.weight", (8, 6), 1, 3, 6),
                       whole[:, 3:6])  # fmt: skip
    other = ckpt.get("model.layers.0.self_attn.k_proj.weight", (8, 6))
    assert not torch.equal(whole, other)  # seeded by name
    assert abs(whole.std().item() - 6**-0.5) < 0.2
    with pytest.raises(ValueError, match="load_format 'npz'"):
        open_checkpoint("m", "npz")


def test_a_dummy_mxfp4_gpt_oss_holds_its_experts_packed_as_the_plan_counts(tmp_path):
    """A gpt-oss config with quant_method mxfp4 (as the Hub ships it) builds its experts
    packed under load_format dummy, as from the real files: the bytes the plan counts, not
    the dense stacks (3.6x of them at gpt-oss-20b), and scales that keep a bf16 forward
    finite."""
    model_dir = config_only(family_model_dir("gptoss"), tmp_path / "gpt-oss",
                            quantization_config={"quant_method": "mxfp4"})  # fmt: skip
    eng = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="bfloat16",
                                 load_format="dummy", adapters={"num_slots": 2}))  # fmt: skip
    model = eng.executor.model
    gate, up, down = model.layers[0].mlp.packed  # the sparse layer's experts, as held
    assert all(isinstance(w, Mxfp4Weight) for w in (gate, up, down))
    assert set(gate.scales.unique().tolist()) == {DUMMY_E8M0}
    assert held_bytes(model) == weight_bytes(eng.spec, 1, torch.bfloat16)
    seq = eng.generate([([5, 6, 7, 8], GREEDY, None)])[0]
    assert len(seq.output_ids) == 6
    assert torch.isfinite(eng.score([5, 6, 7, 8])).all()
