"""The llama family's variants without processes: Llama 3's rescaled rotary frequencies are
HF's, the presets count their published parameters, the FLOPs follow ``head_dim``, the
sliding window's mask is HF's and the KV cache keeps to it, and a rope type hybrid does not
build is refused in one line before anything is built."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from hybrid.errors import UserError
from hybrid.model.context import window_mask
from hybrid.model.kv_cache import LayerCache
from hybrid.model.llama import llama3_frequencies, rotary_tables
from hybrid.planning.config import ModelConfig
from hybrid.planning.cost.flops import layer_forward_flops
from hybrid.planning.cost.sizes import param_count
from hybrid.planning.models import model_spec
from hybrid.planning.params import model_param_specs

ROOT = Path(__file__).resolve().parents[1]


def preset(name: str) -> ModelConfig:
    return ModelConfig(**yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text()))


def test_llama3_frequencies_are_hfs_for_llama_3_2_1b():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = preset("llama3.2-1b")
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor, cfg.rope_original_positions,
            cfg.rope_base, cfg.tie_embeddings) == ("llama3", 32.0, 1.0, 4.0, 8192, 5e5, True)
    hf = LlamaConfig(hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
                     rope_parameters={"rope_type": "llama3", "rope_theta": cfg.rope_base,
                                      "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})
    theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    d = cfg.head_size
    plain = 1.0 / (cfg.rope_base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    ours = llama3_frequencies(plain, cfg)
    assert scale == 1.0 and torch.equal(ours, theirs.float())
    assert not torch.equal(ours, plain)  # the scaling changes some, so the test can fail
    cos, _ = rotary_tables(torch.tensor([1000]), d, cfg.rope_base, cfg)
    assert torch.equal(cos[0, :d // 2], torch.cos(1000 * theirs.float()))


@pytest.mark.parametrize("name, published", [
    # the parameter counts of the HF checkpoints (safetensors metadata)
    ("qwen2.5-0.5b", 494_032_768), ("qwen3-0.6b", 596_049_920),
    ("mistral-7b", 7_241_732_096), ("llama3.2-1b", 1_235_814_400)])
def test_variant_presets_count_the_published_parameters(name, published):
    cfg = preset(name)
    assert param_count(replace(cfg, vocab_pad_multiple=1)) == published


def test_the_variants_parameters_and_their_tp_splits():
    cfg = replace(preset("qwen3-0.6b"), qkv_bias=True)
    specs = model_param_specs(cfg)
    assert specs["blocks.1.attention.qkv.weight"].shape == ((16 + 2 * 8) * 128, 1024)
    assert specs["blocks.1.attention.qkv.bias"].shape == ((16 + 2 * 8) * 128,)
    assert specs["blocks.1.attention.qkv.bias"].tp_dim == 0  # split with its rows
    assert specs["blocks.1.attention.proj.weight"].shape == (1024, 16 * 128)
    norm = specs["blocks.1.attention.q_norm.weight"]
    assert norm.shape == (128,) and norm.tp_dim is None and norm.sequence_partial


def test_layer_flops_follow_head_dim():
    cfg = preset("qwen3-0.6b")
    h, f, s, n, k, d = cfg.hidden, cfg.ffn, cfg.seq_len, cfg.heads, cfg.kv, cfg.head_size
    assert d * n != h
    matmul_weights = (n + 2 * k) * d * h + n * d * h + 3 * h * f
    assert layer_forward_flops(cfg, 1) == 2 * s * matmul_weights + 4 * s * s * n * d


def test_the_window_mask_is_hfs_sliding_window_causal_mask():
    from transformers.masking_utils import and_masks, causal_mask_function, \
        sliding_window_overlay

    hf = and_masks(causal_mask_function, sliding_window_overlay(3))
    positions = torch.arange(7)
    ours = window_mask(positions, positions, 3)
    theirs = [[bool(hf(0, 0, torch.tensor(q), torch.tensor(k))) for k in range(7)]
              for q in range(7)]
    assert ours.tolist() == theirs
    assert ours.sum(dim=1).tolist() == [1, 2, 3, 3, 3, 3, 3]


def test_the_kv_cache_keeps_to_the_window():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 4, generator=g) for _ in range(3))
    positions = torch.arange(12)
    mask = window_mask(positions, positions, 5)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).permute(2, 0, 1, 3)
    cache = LayerCache()
    got = [cache.attend(q[:, :, :7], k[:, :, :7], v[:, :, :7], window=5)]
    got += [cache.attend(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], window=5)
            for t in range(7, 12)]
    assert torch.allclose(torch.cat(got), want.reshape(12, 2, -1), atol=1e-6)
    full = LayerCache()
    full.attend(q[:, :, :7], k[:, :, :7], v[:, :, :7])
    last = full.attend(q[:, :, 7:8], k[:, :, 7:8], v[:, :, 7:8])
    assert not torch.allclose(last, want.reshape(12, 2, -1)[7:8], atol=1e-3)


@pytest.mark.parametrize("change, needle", [
    (dict(rope_scaling="yarn"), "model.rope_scaling='yarn' is not supported; choose one of "
                                "none, llama3"),
    (dict(rope_scaling="llama3", rope_factor=0.5), "model.rope_scaling=llama3 needs "
                                                    "rope_factor >= 1"),
    (dict(sliding_window=0), "model.sliding_window=0 must be an integer >= 1"),
    (dict(head_dim=7), "the head size 7 (model.head_dim"),
])
def test_a_bad_variant_field_is_one_line(change, needle):
    cfg = replace(preset("llama-tiny"), **change)
    with pytest.raises(UserError) as err:
        model_spec(cfg).check_shape(cfg, 1)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_unsupported_rope_type_exits_2_before_launch(tmp_path):
    done = subprocess.run(
        [str(Path(sys.executable).parent / "hybrid-train"), "model=llama-tiny",
         "data=synthetic", "parallel=single", "model.rope_scaling=longrope",
         f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=100)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.rope_scaling='longrope' is not supported" in lines[0]
    assert not (tmp_path / "config.json").exists()
