"""The aux-loss-free expert bias (``model.moe.expert_bias_rate``, docs/moe.md), in process:
it chooses the top k and leaves the combine weights unbiased, it moves a skewed load toward
even, a layer counts its routed slots and the update resets them, the plan predicts the
update's all-reduce, checkpoints and HF export treat it as documented. Its layout invariance,
its bytes counted = predicted and its round trip through a checkpoint are shown through
``hybrid-train`` in ``tests/test_moe.py`` (every MoE run there has it on)."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from test_llama import preset


def test_the_bias_chooses_the_top_k_and_the_weights_stay_unbiased():
    from hybrid.model.moe import route

    logits = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    probs = logits.softmax(dim=-1)
    bias = torch.tensor([0.0, 0.0, 0.0, 2.0])  # expert 3 always chosen
    for router in ("softmax_topk", "topk_softmax"):
        weights, ids = route(logits, 2, router, bias)
        assert (ids == 3).any(dim=-1).all()
        assert torch.equal(ids, torch.topk(probs + bias, 2).indices)
        top = probs.gather(-1, ids)  # the chosen experts' unbiased probabilities
        torch.testing.assert_close(weights, top / top.sum(dim=-1, keepdim=True))
    zero = route(logits, 2, "softmax_topk", torch.zeros(4))
    unbiased = route(logits, 2, "softmax_topk")
    assert torch.equal(zero[1], unbiased[1])
    torch.testing.assert_close(zero[0], unbiased[0])


def test_the_update_moves_a_skewed_load_toward_even():
    from hybrid.model.expert_bias import updated_expert_bias
    from hybrid.model.moe import route

    assert updated_expert_bias(torch.zeros(4), torch.tensor([6, 2, 2, 2]), 0.5).tolist() == \
        [-0.5, 0.5, 0.5, 0.5]
    assert updated_expert_bias(torch.zeros(2), torch.tensor([3, 3]), 0.5).tolist() == [0, 0]
    # a router that prefers expert 0 by far: its load falls toward the mean step by step
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(256, 4, generator=gen) + torch.tensor([1.5, 0.0, 0.0, 0.0])
    bias, ratios = torch.zeros(4), []
    for _ in range(30):
        _, ids = route(logits, 2, "softmax_topk", bias)
        load = torch.bincount(ids.reshape(-1), minlength=4)
        ratios.append(float(load.max() / load.float().mean()))
        bias = updated_expert_bias(bias, load, 0.01)
    assert ratios[0] > 1.5 and max(ratios[-5:]) < 1.1, ratios


class _OneRank:
    """A 1-rank group: nothing moves (the layer's TP regions, the bias's all-reduce)."""

    @staticmethod
    def size():
        return 1

    @staticmethod
    def rank():
        return 0

    @staticmethod
    def all_reduce(tensor):
        pass


def _layer(rate: float, block_id: int = 1) -> nn.Module:
    """A llama layer's stand-in: ``block_id`` and an MoE ``mlp``."""
    from hybrid.model.moe import MoeMLP

    holder = nn.Module()
    holder.block_id = block_id
    holder.mlp = MoeMLP(preset("moe-tiny").with_moe(expert_bias_rate=rate), _OneRank(),
                        generator=torch.Generator().manual_seed(0), sequence_parallel=False)
    return holder


def test_a_layer_counts_its_routed_slots_and_the_update_moves_its_bias():
    from hybrid.model.expert_bias import (expert_biases, load_expert_biases,
                                          update_expert_biases)

    assert _layer(0.0).mlp.expert_bias is None and expert_biases([_layer(0.0)]) == {}
    layer = _layer(0.01, block_id=3)
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer.mlp(x)  # evaluation: not counted
    assert layer.mlp.routed_slots.sum() == 0
    layer.mlp(x)
    layer.mlp(x)  # two micro-batches
    load = layer.mlp.routed_slots.clone()
    assert load.sum() == 2 * 16 * 2  # every routed slot, tokens x top-2
    update_expert_biases([layer], _OneRank())
    assert layer.mlp.routed_slots.sum() == 0
    mean = load.double().mean()
    assert layer.mlp.expert_bias.tolist() == pytest.approx(
        [0.01 * float(torch.sign(mean - n)) for n in load.double()])
    # by global name; a checkpoint without the bias (an older one, an HF import) leaves it
    biases = expert_biases([layer])
    assert list(biases) == ["blocks.3.mlp.expert_bias"]
    other = {"blocks.3.mlp.router.weight": torch.zeros(1)}
    fresh = _layer(0.01, block_id=3)
    assert load_expert_biases([fresh], dict(other)) == other
    assert fresh.mlp.expert_bias.abs().sum() == 0
    left = load_expert_biases([fresh], {**other, **biases})
    assert left == other and torch.equal(fresh.mlp.expert_bias, layer.mlp.expert_bias)


def test_a_full_recompute_counts_every_slot_once():
    """``model.recompute=full`` runs each layer's forward again in the backward: the MoE
    layer routes the same tokens again and must not count them again, so a step's routed
    slots, kept and dropped slots, aux loss and bias update are those without recompute."""
    from hybrid.testing import spawn

    plain, recomputed = spawn(_step_counts, 1)[0]
    assert plain["routed"].sum() == 2 * 16 * 2  # two micro-batches of 16 tokens, top-2
    assert plain["moe"]["dropped"] > 0  # the capacity drops some: counted once as well
    assert recomputed["moe"] == plain["moe"]
    for name in ("routed", "bias", "router_grad"):
        assert torch.equal(recomputed[name], plain[name]), name


def _step_counts(rank, world) -> tuple[dict, dict]:
    """One step of two micro-batches through an MoE llama layer, without and with full
    recompute (same seed, same data): its counts, its bias after the update, its router's
    gradient."""
    from hybrid.groups import ParallelGroups
    from hybrid.model.expert_bias import update_expert_biases
    from hybrid.model.llama import LlamaLayer
    from hybrid.model.moe import moe_step_stats, set_aux_loss_scale
    from hybrid.planning.layout import Layout

    groups = ParallelGroups.create(Layout())
    base = replace(preset("moe-tiny"), moe_expert_bias_rate=0.01, moe_capacity_factor=1.0,
                   init_std=0.2)
    data = torch.randn(2, 8, 2, 32, generator=torch.Generator().manual_seed(1))
    runs = []
    for recompute in ("none", "full"):
        layer = LlamaLayer(replace(base, recompute=recompute), groups.tensor,
                           generator=torch.Generator().manual_seed(0), sequence_parallel=False)
        layer.block_id = 1
        set_aux_loss_scale([layer], 0.5)
        for micro_batch in data:
            layer(micro_batch.clone().requires_grad_()).square().sum().backward()
        routed = layer.mlp.routed_slots.clone()
        moe = moe_step_stats([layer])
        update_expert_biases([layer], _OneRank())
        runs.append({"routed": routed, "moe": moe, "bias": layer.mlp.expert_bias.clone(),
                     "router_grad": layer.mlp.router.weight.grad.clone()})
    return runs[0], runs[1]


@pytest.mark.parametrize("parallel", [dict(dp=2), dict(dp=2, cp=2), dict(dp=2, pp=2),
                                      dict(dp=2, ep=2, tp=2)])
def test_the_plan_predicts_the_bias_all_reduce(parallel):
    from hybrid.planning.config import Config, ParallelConfig
    from hybrid.planning.job import plan_job, rank_dp_bytes
    from hybrid.planning.view import plan_dict

    model = preset("moe-tiny")
    on = Config(model=model.with_moe(expert_bias_rate=1e-3),
                parallel=ParallelConfig(**parallel))
    off = replace(on, model=model)
    plan_on, plan_off = plan_job(on), plan_job(off)
    ranks = parallel["dp"] * parallel.get("cp", 1)  # the ranks with other tokens; not tp
    for pp_rank in range(parallel.get("pp", 1)):
        layers = model.layers // parallel.get("pp", 1)  # each stage its own layers' counts
        payload = layers * model.moe.experts * 8  # int64 routed slots
        extra = rank_dp_bytes(on, plan_on, pp_rank, 2) - rank_dp_bytes(off, plan_off, pp_rank, 2)
        assert extra == 2 * (ranks - 1) / ranks * payload
        assert plan_dict(plan_on)["experts"]["expert_bias_bytes_per_step"][pp_rank] == extra
    assert not any(plan_dict(plan_off)["experts"]["expert_bias_bytes_per_step"])


def _manifest(model) -> dict:
    from hybrid.checkpoint.store import model_shape

    return {"model": model_shape(model), "config": {"model": {"moe_expert_bias_rate": 0.01}},
            "tensors": {"model.blocks.1.mlp.expert_bias": {}, "model.blocks.1.mlp.router.weight": {}}}


def test_a_checkpoint_with_expert_biases_needs_the_bias_on_before_launch():
    from hybrid.checkpoint.store import CheckpointError, check_model_matches

    biased = preset("moe-tiny").with_moe(expert_bias_rate=0.01)
    check_model_matches(_manifest(biased), biased, Path("step_00000003"))
    with pytest.raises(CheckpointError) as err:
        check_model_matches(_manifest(biased), preset("moe-tiny"), Path("step_00000003"))
    line = str(err.value)
    assert "\n" not in line and "set model.moe.expert_bias_rate > 0 (e.g. 0.01)" in line


def test_hf_export_drops_a_zero_bias_and_refuses_a_moved_one():
    from hybrid.interop.hf_dir import ConversionError
    from hybrid.interop.mixtral import to_hf
    from hybrid.planning.params import model_param_specs

    model = preset("moe-tiny").with_moe(expert_bias_rate=0.01)
    weights = {name: torch.zeros(spec.shape) for name, spec in model_param_specs(model).items()}
    biases = {f"blocks.{b}.mlp.expert_bias": torch.zeros(model.moe.experts)
              for b in range(1, model.layers + 1)}
    assert to_hf({**weights, **biases}, model).keys() == to_hf(weights, model).keys()
    biases["blocks.2.mlp.expert_bias"][1] = -0.03
    with pytest.raises(ConversionError, match="blocks.2.mlp.expert_bias is nonzero .max "
                                              r"\|bias\| 0.03, 1 MoE layers.*--format torch"):
        to_hf({**weights, **biases}, model)


def test_a_resume_loads_the_saved_biases_and_leaves_missing_ones_at_zero(capsys):
    """``Checkpointer._bias_targets``: what a resume asks DCP for (only what was saved: an
    older checkpoint, or one saved with the rate at 0, has no bias to load)."""
    from types import SimpleNamespace

    from hybrid.checkpoint.checkpointer import Checkpointer

    biases = {"blocks.1.mlp.expert_bias": torch.zeros(4)}
    rank0 = SimpleNamespace(biases=biases, groups=SimpleNamespace(world=_OneRank()),
                            cfg=SimpleNamespace(model=SimpleNamespace(
                                moe=SimpleNamespace(expert_bias_rate=0.01))))
    saved = {"model.blocks.1.mlp.expert_bias": {}, "model.blocks.1.mlp.router.weight": {}}
    assert Checkpointer._bias_targets(rank0, Path("step_3"), saved) == {
        "model.blocks.1.mlp.expert_bias": biases["blocks.1.mlp.expert_bias"]}
    assert capsys.readouterr().err == ""
    assert Checkpointer._bias_targets(rank0, Path("step_3"), {}) == {}
    assert "step_3 holds no MoE expert bias; the bias starts at zero" in capsys.readouterr().err
