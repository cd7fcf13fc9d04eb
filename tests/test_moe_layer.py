"""The mixture-of-experts MLP (docs/moe.md) on its own: its parameter table and placements,
FLOPs and parameter count, the router and the load-balancing loss, bf16 autocast, the
all-to-all's predicted bytes and ``hybrid-plan``'s expert groups, and one-line errors before
launch. The losses through ``hybrid-train`` are test_moe's."""

from dataclasses import replace

import pytest
import torch

from hybrid.planning.config import ModelConfig
from hybrid.planning.cost.flops import layer_forward_flops
from hybrid.planning.cost.sizes import block_params, param_count
from hybrid.planning.layout import LayoutError
from hybrid.planning.param_spec import DENSE, EXPERT
from hybrid.planning.params import model_param_specs
from hybrid.planning.validate import check_model_shape
from test_llama import preset, run_train

MOE = ["model=moe-tiny", "model.moe.expert_bias_rate=0.01"]
"""moe-tiny with the aux-loss-free expert bias on too (every run below, the reference's as
well): each layout's losses and final biases are the 1-process run's."""



def test_moe_layers_carry_a_router_and_stacked_experts_with_the_expert_placement():
    cfg = preset("moe-tiny").with_moe(every=2)
    specs = model_param_specs(cfg)
    e, f, h = cfg.moe.experts, cfg.moe_ffn, cfg.hidden
    assert specs["blocks.1.mlp.router.weight"].shape == (e, h)
    assert specs["blocks.1.mlp.router.weight"].placement == DENSE
    assert specs["blocks.1.mlp.router.weight"].sequence_partial  # partial over TP
    for name, shape, dim in (("gate", (e, f, h), 1), ("up", (e, f, h), 1),
                             ("down", (e, h, f), 2)):
        spec = specs[f"blocks.1.mlp.experts.{name}"]
        assert (spec.shape, spec.tp_dim, spec.placement) == (shape, dim, EXPERT)
    # moe_every=2: layers 1 and 3 are sparse, 2 and 4 keep the SwiGLU
    assert "blocks.2.mlp.gate.weight" in specs and "blocks.3.mlp.router.weight" in specs
    assert "blocks.4.mlp.gate.weight" in specs and "blocks.4.mlp.router.weight" not in specs


def test_param_count_and_flops_know_the_experts():
    dense = preset("moe-tiny").with_moe(experts=0)
    cfg = preset("moe-tiny").with_moe(every=2)
    h, e, f = cfg.hidden, cfg.moe.experts, cfg.moe_ffn
    per_moe = e * h + 3 * e * f * h - 3 * h * dense.ffn  # router + experts - SwiGLU
    assert param_count(cfg) == param_count(dense) + 2 * per_moe
    assert sum(b.total for b in block_params(cfg)) == param_count(cfg)
    tokens = cfg.seq_len
    moe_mlp = tokens * (2 * e * h + cfg.moe.topk * 6 * h * f)
    dense_mlp = 6 * tokens * h * dense.ffn
    assert cfg.layers * layer_forward_flops(cfg, 1) == pytest.approx(
        cfg.layers * layer_forward_flops(dense, 1) + 2 * (moe_mlp - dense_mlp))


def test_the_torch_model_builds_exactly_the_spec_table():
    from hybrid.model.moe import MoeMLP  # noqa: F401  (build through the family below)
    from hybrid.testing import spawn

    assert spawn(_count_built, 1)[0] == param_count(preset("moe-tiny").with_moe(every=2))


def _count_built(rank, world):
    from hybrid.groups import ParallelGroups
    from hybrid.model.gpt import GPT
    from hybrid.planning.layout import Layout

    model = GPT(preset("moe-tiny").with_moe(every=2), ParallelGroups.create(Layout()),
                seed=1)  # attach_specs checks names, order and shapes against the specs
    return sum(p.numel() for p in model.parameters())


def test_both_routers_give_the_same_weights_and_capacity_drops_in_token_order():
    from hybrid.model.moe import kept_slots, load_balancing_loss, route

    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    (w1, ids1), (w2, ids2) = route(logits, 2, "softmax_topk"), route(logits, 2, "topk_softmax")
    assert torch.equal(ids1, ids2)
    torch.testing.assert_close(w1, w2)
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    keep = kept_slots(ids, 4, capacity=2)  # expert 0's third and fourth slots are dropped
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    assert kept_slots(ids, 4, capacity=None).all()
    even = torch.full((4, 4), 0.25)
    balanced = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert load_balancing_loss(even, balanced, 4).item() == pytest.approx(1.0)


def test_the_aux_loss_adds_its_scaled_gradient_and_leaves_the_output_alone():
    from hybrid.model.moe import AuxLossGradient

    out = torch.randn(3, requires_grad=True)
    aux_in = torch.randn(2, requires_grad=True)
    aux = (aux_in ** 2).sum()
    result = AuxLossGradient.apply(out, aux, 0.5)
    assert torch.equal(result, out)
    result.sum().backward()
    torch.testing.assert_close(aux_in.grad, 0.5 * 2 * aux_in.detach())
    torch.testing.assert_close(out.grad, torch.ones(3))


@pytest.mark.parametrize("change, needle", [
    ({"topk": 5}, "model.moe.topk=5 exceeds model.moe.experts=4; choose "
                          "model.moe.topk in 1..4"),
    ({"capacity_factor": 0.0}, "model.moe.capacity_factor=0.0 must be a number > 0"),
    ({"capacity_factor": -1.0}, "model.moe.capacity_factor=-1.0 must be a number > 0"),
    ({"aux_loss": -0.1}, "model.moe.aux_loss=-0.1 must be a number >= 0"),
    ({"every": 0}, "model.moe.every=0 must be an integer >= 1"),
    ({"experts": -2}, "model.moe.experts=-2 must be an integer >= 1"),
    ({"expert_bias_rate": -0.001}, "model.moe.expert_bias_rate=-0.001 must be a number "
                                        ">= 0"),
    ({"router": "sinkhorn"}, "model.moe.router='sinkhorn' is not one of softmax_topk, "
                                 "topk_softmax"),
    ({"ffn_hidden": 31}, None),  # tp=2 below does not split 31
])
def test_bad_moe_settings_are_one_line(change, needle):
    cfg = preset("moe-tiny").with_moe(**change)
    with pytest.raises(LayoutError) as err:
        check_model_shape(cfg, tp=2 if needle is None else 1)
    line = str(err.value)
    assert "\n" not in line
    if needle is None:
        needle = "parallel.tp=2 does not divide model.moe.ffn_hidden=31; choose tp in {1}"
    assert needle in line


def test_gpt2_with_experts_is_refused_naming_the_family():
    cfg = ModelConfig(experts=4)
    with pytest.raises(LayoutError, match="model.moe.experts=4 asks for a mixture of experts, "
                                          "which model.family=gpt2 has not"):
        check_model_shape(cfg, 1)


def test_bad_moe_setting_exits_2_with_one_line_before_launch(tmp_path):
    done = run_train(tmp_path, *MOE, "model.moe.topk=8", timeout=90)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.moe.topk=8 exceeds model.moe.experts=4" in lines[0]
    assert "Traceback" not in done.stderr and not (tmp_path / "config.json").exists()


def test_the_layer_runs_under_bf16_autocast_close_to_fp32():
    from hybrid.testing import spawn

    fp32, bf16 = spawn(_mlp_outputs, 1)[0]
    assert bf16.dtype == torch.float32  # the residual stream stays fp32
    torch.testing.assert_close(bf16, fp32, rtol=0.05, atol=0.02)


def _mlp_outputs(rank, world):
    from hybrid.groups import ParallelGroups
    from hybrid.model.moe import MoeMLP
    from hybrid.planning.layout import Layout

    groups = ParallelGroups.create(Layout())
    mlp = MoeMLP(replace(preset("moe-tiny"), init_std=0.2), groups.tensor,
                 generator=torch.Generator().manual_seed(0), sequence_parallel=False)
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = mlp(x)
    low.sum().backward()
    return mlp(x).detach(), low.detach()


EP = ["model=moe-tiny", "data=synthetic", "parallel=single", "parallel.dp=2", "parallel.ep=2"]


@pytest.mark.parametrize("overrides, needle", [
    (["parallel.ep=4"], "parallel.ep=4 does not divide dp*cp=2 (the ranks experts are spread "
                        "over); choose ep in {1, 2}"),
    (["model.moe.experts=3"], "parallel.ep=2 does not divide model.moe.experts=3; choose ep in {1}"),
    (["model.moe.experts=0"], "parallel.ep=2 spreads experts, but model.moe.experts=0"),
])
def test_a_bad_expert_parallel_setting_is_one_line_before_launch(overrides, needle, tmp_path):
    from refusals import refusal_in_process

    line = refusal_in_process([*EP, *overrides], tmp_path)
    assert needle in line, line
    assert not any(tmp_path.iterdir())  # nothing written


def test_the_all_to_all_prediction_counts_the_travelling_slots():
    from hybrid.planning.cost.moe_traffic import a2a_layer_bytes

    # 8 tokens x top-2 over 4 experts: 4 slots each; at ep=2 two experts' 8 slots travel,
    # 3 floats wide, fp32 both ways, after 2 int64 counts; the backward sends them back
    forward = 2 * 8 + 8 * 3 * (4 + 4)
    assert a2a_layer_bytes(tokens=8, hidden=3, topk=2, experts=4, ep=2,
                           backward=False) == forward
    assert a2a_layer_bytes(tokens=8, hidden=3, topk=2, experts=4, ep=2) == forward + 8 * 3 * 8
    assert a2a_layer_bytes(tokens=8, hidden=3, topk=2, experts=4, ep=1) == 0
    # capacity 1.0 * 8 * 2 / 4 = 4: an even load drops nothing; 0.5 keeps 2 of each 4
    assert a2a_layer_bytes(tokens=8, hidden=3, topk=2, experts=4, ep=2,
                           capacity_factor=0.5, backward=False) == 2 * 8 + 4 * 3 * 8


def test_hybrid_plan_shows_the_expert_groups_and_prices_the_all_to_all():
    from hybrid.planning.config import Config, ParallelConfig
    from hybrid.planning.cost.devices import load_device
    from hybrid.planning.cost.steptime import predict_step
    from hybrid.planning.job import plan_job
    from hybrid.planning.view import format_plan, plan_dict

    cfg = Config(model=preset("moe-tiny"), parallel=ParallelConfig(dp=4, tp=2, ep=2))
    plan = plan_job(cfg)
    shown = plan_dict(plan)
    assert shown["groups"]["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shown["groups"]["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shown["experts"]["a2a_bytes_per_step"][0] > 0
    assert "ep (experts' all-to-all)" in format_plan(shown)
    dense = plan_job(replace(cfg, parallel=ParallelConfig(dp=4, tp=2)))
    device = load_device("cpu")
    assert predict_step(plan, device).step_time_s > predict_step(dense, device).step_time_s
