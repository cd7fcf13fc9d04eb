"""Layers as specs (``hybrid.planning.models.layers``, docs/moe.md): a model's layers are a
list of kinds from its config (dense MLP, or MoE MLP with an optional shared expert), and the
parameters, FLOPs, activation bytes and the pipeline partition are counted layer by layer from
it. Pure (no processes), except one build of the torch model against the spec table."""


import pytest
import torch

from hybrid.planning.config import Config, ModelConfig
from hybrid.planning.cost.block_costs import partition_for_config, predicted_block_costs
from hybrid.planning.cost.flops import block_forward_flops, layer_forward_flops
from hybrid.planning.cost.sizes import estimate_memory, param_count
from hybrid.planning.layout import LayoutError
from hybrid.planning.models.layers import LayerSpec, layer_kinds, layer_specs
from hybrid.planning.moe_config import MoEConfig
from hybrid.planning.params import model_param_specs
from hybrid.planning.validate import check_model_shape

QWEN_LIKE = ModelConfig(family="llama", layers=8, hidden=64, heads=4, kv_heads=2, ffn_hidden=128,
                        moe=MoEConfig(experts=4, topk=2, ffn_hidden=128, shared_ffn_hidden=64,
                                      dense_layers=[1, 2, 3, 4], norm_topk_prob=False),
                        qkv_bias=True, vocab=256)
"""Dense first layers (1-4), then MoE layers with a shared expert: Qwen2-MoE's kinds."""


def test_the_layer_kinds_follow_moe_every_the_dense_list_and_the_shared_expert():
    moe = LayerSpec(moe=True, shared_ffn=64)
    assert layer_specs(QWEN_LIKE) == [LayerSpec()] * 4 + [moe] * 4
    assert [s.kind for s in layer_specs(QWEN_LIKE.with_moe(every=2, dense_layers=[5]))] \
        == ["moe+shared", "dense", "moe+shared", "dense", "dense", "dense", "moe+shared", "dense"]
    assert layer_kinds(QWEN_LIKE.with_moe(experts=0)) == {LayerSpec(): 8}
    assert [QWEN_LIKE.is_moe_layer(b) for b in (4, 5)] == [False, True]  # the same rule


def test_each_layer_counts_its_own_parameters_and_flops():
    specs = model_param_specs(QWEN_LIKE)
    h, s = QWEN_LIKE.hidden, 64
    assert "blocks.4.mlp.gate.weight" in specs and "blocks.4.mlp.router.weight" not in specs
    assert specs["blocks.5.mlp.shared.gate"].shape == (s, h)
    assert specs["blocks.5.mlp.shared.down"].tp_dim == 1
    gate = specs["blocks.5.mlp.shared_gate.weight"]
    assert gate.shape == (1, h) and gate.tp_dim is None and gate.sequence_partial
    dense = QWEN_LIKE.with_moe(experts=0)
    e, f = QWEN_LIKE.experts, QWEN_LIKE.moe_ffn
    per_moe = e * h + 3 * e * f * h + 3 * s * h + h - 3 * h * QWEN_LIKE.ffn
    assert param_count(QWEN_LIKE) == param_count(dense) + 4 * per_moe
    tokens = QWEN_LIKE.seq_len
    moe_mlp = tokens * (2 * e * h + 2 * 6 * h * f + 6 * h * s + 2 * h)
    dense_mlp = 6 * tokens * h * QWEN_LIKE.ffn
    assert block_forward_flops(QWEN_LIKE, 1, 1) == layer_forward_flops(dense, 1)
    assert block_forward_flops(QWEN_LIKE, 1, 5) - block_forward_flops(QWEN_LIKE, 1, 1) == \
        moe_mlp - dense_mlp
    total = sum(block_forward_flops(QWEN_LIKE, 1, b) for b in range(1, 9))
    assert QWEN_LIKE.layers * layer_forward_flops(QWEN_LIKE, 1) == pytest.approx(total)


def test_a_stage_of_moe_layers_keeps_more_activations_than_one_of_dense_layers():
    args = dict(tp=1, dp=1, zero=0, micro_batch=2, inflight=1, sp=False, precision="fp32")
    dense_stage = estimate_memory(QWEN_LIKE, [[1, 2, 3, 4]], **args).activation_bytes
    moe_stage = estimate_memory(QWEN_LIKE, [[5, 6, 7, 8]], **args).activation_bytes
    assert moe_stage > dense_stage
    plain = QWEN_LIKE.with_moe(experts=0)  # alike layers: 4 times one layer's, as ever
    assert estimate_memory(plain, [[1, 2, 3, 4]], **args).activation_bytes == dense_stage


def test_on_pp2_with_dense_first_layers_the_moe_stage_gets_fewer_layers():
    cfg = Config()
    cfg.model = QWEN_LIKE
    cfg.parallel.pp, cfg.parallel.partition = 2, "measured"  # predicted FLOPs until measured
    costs = predicted_block_costs(cfg)
    assert costs[5] > costs[4] == costs[1] > 0  # an MoE layer weighs more than a dense one
    first, second = partition_for_config(cfg)
    layers = [[b for b in stage if 1 <= b <= 8] for stage in (first, second)]
    assert len(layers[1]) < 4 < len(layers[0])  # the MoE stage holds fewer layers
    assert all(b >= 5 for b in layers[1])
    loads = [sum(costs[b] for b in stage) for stage in (first, second)]
    assert max(loads) / min(loads) < 1.3  # balanced by the per-layer costs


def test_route_leaves_the_top_k_unnormalised_when_asked():
    from hybrid.model.moe import route

    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    weights, ids = route(logits, 2, "softmax_topk", normalize=False)
    torch.testing.assert_close(weights, logits.softmax(-1).gather(-1, ids))
    assert (weights.sum(-1) < 1).all()
    normalised, same = route(logits, 2, "softmax_topk")
    assert torch.equal(ids, same)
    torch.testing.assert_close(normalised, weights / weights.sum(-1, keepdim=True))
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])  # expert 3 always chosen, weighed unbiased
    biased, ids = route(logits, 2, "softmax_topk", bias, normalize=False)
    assert (ids == 3).any(-1).all()
    torch.testing.assert_close(biased, logits.softmax(-1).gather(-1, ids))


@pytest.mark.parametrize("change, needle", [
    ({"dense_layers": [0]}, "model.moe.dense_layers=[0] holds 0, not a layer; list layers "
                                "in 1..8"),
    ({"shared_ffn_hidden": -1}, "model.moe.shared_ffn_hidden=-1 must be an integer >= 0"),
    ({"router": "topk_softmax"}, "model.moe.norm_topk_prob=false needs "
                                     "model.moe.router=softmax_topk"),
])
def test_bad_layer_settings_are_one_line(change, needle):
    with pytest.raises(LayoutError) as err:
        check_model_shape(QWEN_LIKE.with_moe(**change))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_tp_must_divide_the_shared_expert():
    with pytest.raises(LayoutError, match=r"parallel.tp=2 does not divide "
                                          r"model.moe.shared_ffn_hidden=7; choose tp in \{1\}"):
        check_model_shape(QWEN_LIKE.with_moe(shared_ffn_hidden=7), tp=2)


def test_the_torch_model_builds_each_layer_from_its_spec():
    from hybrid.testing import spawn

    kinds, count = spawn(_built, 1)[0]
    assert kinds == ["SwiGLU"] * 4 + ["MoeMLP"] * 4
    assert count == param_count(QWEN_LIKE)


def _built(rank, world):
    from hybrid.groups import ParallelGroups
    from hybrid.model.gpt import GPT
    from hybrid.planning.layout import Layout

    model = GPT(QWEN_LIKE, ParallelGroups.create(Layout()), seed=1)  # checks the spec table
    kinds = [type(m.mlp).__name__ for m in model.modules() if hasattr(m, "mlp_norm")]
    return kinds, sum(p.numel() for p in model.parameters())


def test_the_ranks_time_one_layer_of_each_kind_and_give_each_layer_its_kinds_time():
    from hybrid.pipeline.calibrate import timed_blocks
    from hybrid.testing import spawn

    assert timed_blocks(QWEN_LIKE) == [0, 1, 5, 9]
    assert timed_blocks(QWEN_LIKE.with_moe(experts=0)) == [0, 1, 9]
    forward, backward = spawn(_agreed, 1)[0]
    assert len(forward) == len(backward) == 10
    for seconds in (forward, backward):
        assert len(set(seconds[1:5])) == 1 and len(set(seconds[5:9])) == 1
        assert seconds[1] != seconds[5]  # two kinds, timed apart


def _agreed(rank, world):
    from hybrid.groups import ParallelGroups
    from hybrid.pipeline.calibrate import agreed_block_seconds
    from hybrid.planning.layout import Layout

    cfg = Config()
    cfg.model = QWEN_LIKE
    return agreed_block_seconds(cfg, ParallelGroups.create(Layout()), runs=1)
