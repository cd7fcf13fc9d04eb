"""A checkpoint of another model shape, MoE fields included, is refused before launch in one
line naming every field that differs with both values (``hybrid/checkpoint/shape.py``); a
rotary family's context is no shape. The pure checks here; through ``hybrid-train`` (resume
and init_from: dense as MoE, MoE as dense, 4 experts as 8, moe_ffn_hidden, moe_every) below,
marked slow."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.checkpoint.shape import saved_shape
from hybrid.checkpoint.store import CheckpointError, check_model_matches, model_shape
from hybrid.planning.config import ModelConfig

MOE = dict(family="llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=256, seq_len=32,
           experts=4, moe_ffn_hidden=32, moe_every=1)
TRAIN = str(Path(sys.executable).parent / "hybrid-train")


def manifest_of(model: ModelConfig, config_model: dict | None = None) -> dict:
    return {"model": model_shape(model), "config": {"model": config_model or {}},
            "tensors": {}}


def refusal(saved: ModelConfig, wanted: ModelConfig, padding: bool = True) -> str:
    with pytest.raises(CheckpointError) as err:
        check_model_matches(manifest_of(saved), wanted, Path("step_00000004"), padding)
    return str(err.value)


@pytest.mark.parametrize("change, named", [
    ({"experts": 0}, "experts=4, the config experts=0"),
    ({"experts": 8}, "experts=4, the config experts=8"),
    ({"moe_ffn_hidden": 48}, "moe_ffn=32, the config moe_ffn=48"),
    ({"moe_every": 2}, "moe_every=1, the config moe_every=2"),
])
def test_each_moe_field_is_a_shape(change, named):
    line = refusal(ModelConfig(**MOE), ModelConfig(**{**MOE, **change}))
    assert named in line and "\n" not in line, line
    key, value = next(iter(change.items()))
    new = {"experts": "moe.experts", "moe_ffn_hidden": "moe.ffn_hidden",
           "moe_every": "moe.every"}[key]
    assert f"set model.{new}={MOE[key]} " in line, line  # the advice gives the saved value


def test_a_dense_checkpoint_as_moe_names_every_differing_field_at_once():
    dense = ModelConfig(**{**MOE, "experts": 0, "ffn_hidden": 64})
    line = refusal(dense, ModelConfig(**{**MOE, "layers": 4}))
    assert line.startswith("model.layers, model.ffn_hidden, model.moe.experts: "), line
    assert "has layers=2, ffn=64, experts=0, the config layers=4, ffn=" in line, line
    assert "set model.layers=2 model.ffn_hidden=64 model.moe.experts=0 to match it" in line, line


def test_the_moe_only_fields_are_not_compared_when_either_model_is_dense():
    dense = ModelConfig(**{**MOE, "experts": 0})
    check_model_matches(manifest_of(dense), ModelConfig(**{**MOE, "experts": 0,
                                                            "moe_every": 2}), Path("s"))


def test_a_manifest_from_before_the_moe_fields_reads_them_from_its_saved_config():
    moe = ModelConfig(**MOE)
    old = manifest_of(moe, {"experts": 4, "moe_every": 1, "moe_ffn_hidden": 32})
    for field in ("experts", "moe_ffn", "moe_every"):
        del old["model"][field]
    assert saved_shape(old)["experts"] == 4 and saved_shape(old)["moe_ffn"] == 32
    with pytest.raises(CheckpointError, match="experts=4, the config experts=0"):
        check_model_matches(old, ModelConfig(**{**MOE, "experts": 0}), Path("s"))
    bare = manifest_of(moe)  # a weights-only import from before: no config, dense
    del bare["model"]["experts"]
    assert saved_shape(bare)["experts"] == 0


def test_a_rotary_familys_context_is_not_a_shape():
    saved = ModelConfig(**MOE)
    check_model_matches(manifest_of(saved), ModelConfig(**{**MOE, "seq_len": 64}), Path("s"))
    gpt2 = ModelConfig(layers=2, hidden=32, heads=4, vocab=256, seq_len=32)
    with pytest.raises(CheckpointError, match="learned positions for 32 tokens"):
        check_model_matches(manifest_of(gpt2), ModelConfig(**{**gpt2.__dict__, "seq_len": 64}),
                            Path("s"))


COMMON = ["model=moe-tiny", "data=synthetic", "parallel=single", "train.global_batch=2",
          "train.micro_batch=1", "train.log_every=100", "train.timeline_step=0"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("moe-run")
    done = subprocess.run([TRAIN, *COMMON, "train.steps=2", "checkpoint.every=2",
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", ["resume_from", "init_from"])
@pytest.mark.parametrize("change, named", [
    (["model.moe.experts=0"], "model.moe.experts: the checkpoint step_00000002 has experts=4, the "
                          "config experts=0; set model.moe.experts=4 to match it"),
    (["model.moe.experts=8"], "experts=4, the config experts=8"),
    (["model.moe.ffn_hidden=48"], "moe_ffn=32, the config moe_ffn=48"),
    (["model.moe.every=2", "model.layers=6"],
     "model.layers, model.moe.every: the checkpoint step_00000002 has layers=4, moe_every=1"),
    (["model.qkv_bias=true", "model.qk_norm=true"],
     "model.qkv_bias, model.qk_norm: the checkpoint step_00000002 has qkv_bias=false, "
     "qk_norm=false, the config qkv_bias=true, qk_norm=true; set model.qkv_bias=false "
     "model.qk_norm=false to match it"),
])
def test_hybrid_train_refuses_another_moe_shape_before_launch(moe_run, tmp_path, how, change,
                                                              named):
    done = subprocess.run([TRAIN, *COMMON, "train.steps=4", f"checkpoint.{how}={moe_run}",
                           *change, f"hydra.run.dir={tmp_path / 'new'}"],
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and named in errors[0], lines
    assert all(re.match(r"(warning|error): ", line) for line in lines), lines
    assert not (tmp_path / "new" / "workers").exists()  # refused before any worker started


# -- the llama variants: which tensors exist is a shape, the rope and norms' epsilon are not --

LLAMA = dict(family="llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=256, seq_len=32)


@pytest.mark.parametrize("padding", [True, False], ids=["resume", "init_from"])
@pytest.mark.parametrize("change, named, fix", [
    ({"qkv_bias": True}, "has qkv_bias=false, the config qkv_bias=true", "model.qkv_bias=false"),
    ({"qk_norm": True}, "has qk_norm=false, the config qk_norm=true", "model.qk_norm=false"),
    ({"head_dim": 16}, "has head_size=8, the config head_size=16", "model.head_dim=8"),
])
def test_each_variant_field_is_a_shape(change, named, fix, padding):
    line = refusal(ModelConfig(**LLAMA), ModelConfig(**{**LLAMA, **change}), padding)
    assert line.startswith(f"model.{next(iter(change))}: ") and named in line, line
    assert f"set {fix} to match it" in line and "\n" not in line, line


def test_an_explicit_head_dim_of_hidden_over_heads_is_the_same_shape():
    check_model_matches(manifest_of(ModelConfig(**LLAMA)),
                        ModelConfig(**{**LLAMA, "head_dim": 8}), Path("s"))


def test_a_manifest_from_before_the_variant_fields_reads_them_from_its_saved_config():
    qwen3 = ModelConfig(**{**LLAMA, "head_dim": 16, "qk_norm": True})
    old = manifest_of(qwen3, {"head_dim": 16, "qk_norm": True})
    for field in ("head_size", "qkv_bias", "qk_norm"):
        del old["model"][field]
    assert saved_shape(old)["head_size"] == 16 and saved_shape(old)["qk_norm"] is True
    with pytest.raises(CheckpointError, match="head_size=16, qk_norm=true, the config "
                                              "head_size=8, qk_norm=false"):
        check_model_matches(old, ModelConfig(**LLAMA), Path("s"))
    bare = manifest_of(ModelConfig(**LLAMA))
    for field in ("head_size", "qkv_bias", "qk_norm"):
        del bare["model"][field]
    assert (saved_shape(bare)["head_size"], saved_shape(bare)["qkv_bias"]) == (8, False)


SCALED = dict(rope_scaling="llama3", rope_factor=8.0, rope_original_positions=32)


@pytest.mark.parametrize("change, named", [
    ({"rope_base": 500000.0}, ["model.rope_base=500000.0 (the checkpoint's: 10000.0)"]),
    (SCALED, ["model.rope_scaling=llama3 (the checkpoint's: none)",
              "model.rope_factor=8.0 (the checkpoint's: 1.0)",
              "model.rope_original_positions=32 (the checkpoint's: 8192)"]),
    ({"norm_eps": 1e-6, "sliding_window": 8, "experts_topk": 1},
     ["model.norm_eps=1e-06", "model.sliding_window=8 (the checkpoint's: null)",
      "model.moe.topk=1 (the checkpoint's: 2)"]),
    ({"rope_factor": 4.0}, []),  # no llama3 scaling on either side: the factor means nothing
])
def test_a_setting_no_weight_depends_on_loads_and_is_named(change, named):
    from hybrid.checkpoint.shape import setting_changes

    saved = ModelConfig(**LLAMA)
    manifest = manifest_of(saved, dict(saved.__dict__))
    wanted = ModelConfig(**{**LLAMA, **change})
    for padding in (True, False):
        check_model_matches(manifest, wanted, Path("s"), padding)
    changes = setting_changes(manifest, wanted)
    assert len(changes) == len(named) and all(
        any(text in change for change in changes) for text in named), changes


def test_a_tensor_the_model_has_no_parameter_for_is_refused_not_dropped():
    import torch

    from hybrid.checkpoint.weights import check_no_foreign_tensors
    from hybrid.planning.params import model_param_specs

    names = set(model_param_specs(ModelConfig(**LLAMA)))
    biased = set(model_param_specs(ModelConfig(**{**LLAMA, "qkv_bias": True})))
    weights = {name: torch.zeros(1) for name in biased}
    check_no_foreign_tensors({n: weights[n] for n in names}, names, Path("s"))
    with pytest.raises(CheckpointError, match=r"holds 2 tensors this model has no parameter "
                                              r"for \(first: blocks.1.attention.qkv.bias\)"):
        check_no_foreign_tensors(weights, names, Path("s"))
