"""Parameter counts against the standard GPT formula, real models, and the model presets."""

from dataclasses import fields, replace
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import yaml

from hybrid.planning.config import ModelConfig
from hybrid.planning.moe_config import MoEConfig
from hybrid.groups import ParallelGroups
from hybrid.planning.layout import Layout
from hybrid.planning.cost.sizes import param_count
from hybrid.testing import spawn
from hybrid.planning.validate import check_model_shape, valid_tp_sizes

pytestmark = pytest.mark.timeout(120)

PRESETS = Path(__file__).resolve().parents[1] / "conf" / "model"


def preset_fields(text: str) -> dict:
    """A preset's ``model.*`` fields (nested under ``model:`` in a preset that also sets its
    published ``train.global_batch``: ``# @package _global_``)."""
    data = yaml.safe_load(text)
    return data["model"] if text.startswith("# @package _global_") else data


def load_preset(name: str) -> ModelConfig:
    return ModelConfig(**preset_fields((PRESETS / f"{name}.yaml").read_text()))


def standard_formula(layers: int, hidden: int, vocab: int, seq: int) -> int:
    """12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)), evaluated exactly."""
    l, h = Fraction(layers), Fraction(hidden)
    value = 12 * l * h**2 * (1 + Fraction(13) / (12 * h) + (vocab + seq) / (12 * l * h))
    assert value.denominator == 1
    return int(value)


@pytest.mark.parametrize("name", ["gpt2-124m", "gpt2-350m", "gpt3-1.3b", "gpt3-13b", "gpt3-175b"])
def test_param_count_is_the_standard_formula_plus_final_norm_and_untied_head(name):
    cfg = load_preset(name)
    h, vocab = cfg.hidden, cfg.padded_vocab
    formula = standard_formula(cfg.layers, h, vocab, cfg.seq_len)
    tied, untied = replace(cfg, tie_embeddings=True), replace(cfg, tie_embeddings=False)
    assert param_count(tied) == formula + 2 * h
    assert param_count(untied) == formula + 2 * h + vocab * h


def test_gpt2_counts_match_the_published_checkpoints_before_padding():
    # Hugging Face gpt2 / gpt2-medium: 124,439,808 and 354,823,168 parameters (tied, V=50257).
    assert param_count(replace(load_preset("gpt2-124m"), vocab_pad_multiple=1)) == 124_439_808
    assert param_count(replace(load_preset("gpt2-350m"), vocab_pad_multiple=1)) == 354_823_168


@pytest.mark.parametrize("name, nominal", [
    ("gpt3-125m", 125e6), ("gpt3-350m", 350e6), ("gpt3-760m", 760e6), ("gpt3-1.3b", 1.3e9),
    ("gpt3-2.7b", 2.7e9), ("gpt3-6.7b", 6.7e9), ("gpt3-13b", 13.0e9), ("gpt3-175b", 175.0e9),
])
def test_gpt3_presets_have_their_nominal_size(name, nominal):
    cfg = load_preset(name)
    assert (cfg.seq_len, cfg.vocab, cfg.tie_embeddings) == (2048, 50257, True)
    assert param_count(cfg) == pytest.approx(nominal, rel=0.03)


FEW_KV_HEADS = {"llama-tiny": [1, 2], "moe-tiny": [1, 2], "smollm-135m": [1, 3], "smollm-360m": [1, 5], "tinyllama-1.1b": [1, 2, 4], "qwen2.5-0.5b": [1, 2]}
"""Presets TP cannot split 2, 4 or 8 ways: tp must divide kv_heads (2 in llama-tiny, to test
grouped-query attention at tp=2; the published shapes of the others)."""


SHAPE_FIELDS = {f.name for f in fields(ModelConfig)} - {"from_hf", "moe"}
"""What every preset lists: every field but the HF folder a run may take its shape from
instead, and the MoE block (``model.moe``), which only an MoE preset lists."""
MOE_FIELDS = {f.name for f in fields(MoEConfig)}


def assert_complete(listed: dict, name: str) -> None:
    """A dense preset lists every non-MoE field and no MoE one (neither the ``moe:`` block nor
    a flat key of before); an MoE preset the whole ``moe:`` block too, with experts > 0."""
    assert set(listed) - {"moe"} == SHAPE_FIELDS, name
    if "moe" in listed:
        assert set(listed["moe"]) == MOE_FIELDS, name
        assert listed["moe"]["experts"] > 0, f"{name}: a dense preset lists no moe block"


def test_the_completeness_rule_refuses_a_dense_preset_with_moe_fields():
    dense = preset_fields((PRESETS / "llama-tiny.yaml").read_text())
    moe = preset_fields((PRESETS / "moe-tiny.yaml").read_text())
    assert_complete(dense, "llama-tiny") is None and assert_complete(moe, "moe-tiny") is None
    for wrong in ({**dense, "experts": 0}, {**dense, "moe": {**moe["moe"], "experts": 0}},
                  {**dense, "moe": {"experts": 4}}, {**moe, "moe_aux_loss": 0.01}):
        with pytest.raises(AssertionError):
            assert_complete(wrong, "wrong")


def test_every_preset_is_a_complete_model_config_that_splits_over_tp():
    names = sorted(p.stem for p in PRESETS.glob("*.yaml"))
    assert {"tiny", "small", "gpt2-124m", "gpt2-350m", "gpt2-1.3b", "gpt3-175b"} <= set(names)
    for name in names:
        text = (PRESETS / f"{name}.yaml").read_text()
        assert text.startswith("# "), f"{name}.yaml must start with a comment line"
        assert_complete(preset_fields(text), name)
        cfg = load_preset(name)
        assert cfg.name == name
        check_model_shape(cfg, 1)
        if name in FEW_KV_HEADS:
            assert valid_tp_sizes(cfg) == FEW_KV_HEADS[name], name
            continue
        assert {1, 2, 4} <= set(valid_tp_sizes(cfg)), name
        if param_count(cfg) > 1e9:
            assert 8 in valid_tp_sizes(cfg), name  # one 8-GPU node per TP group


TINY = dict(layers=2, hidden=32, heads=4, vocab=100, vocab_pad_multiple=64, seq_len=16)
REAL_MODEL_CASES = [dict(tie_embeddings=False), dict(tie_embeddings=True),
                    dict(tie_embeddings=False, ffn_hidden=48)]


def _numel_job(rank, world):
    from hybrid.model import GPT

    reference = ParallelGroups.create(Layout())
    tp2 = ParallelGroups.create(Layout(tp=2))
    out = []
    for extra in REAL_MODEL_CASES:
        cfg = ModelConfig(**TINY, **extra)
        full = sum(p.numel() for p in GPT(cfg, reference, seed=0).parameters())
        sharded = replicated = 0
        for p in GPT(cfg, tp2, seed=0).parameters():
            if getattr(p, "tensor_model_parallel", False):
                sharded += p.numel()
            else:
                replicated += p.numel()
        total = torch.tensor([sharded])
        tp2.tensor.all_reduce(total)
        out.append((full, int(total) + replicated))
    return out


def test_param_count_equals_the_real_models_numel_on_one_and_two_ranks():
    results = spawn(_numel_job, 2, timeout=60)
    for extra, (full, tp2_total) in zip(REAL_MODEL_CASES, results[0]):
        expected = param_count(ModelConfig(**TINY, **extra))
        assert full == expected, extra
        assert tp2_total == expected, extra  # shards sum to the whole, replicas counted once
