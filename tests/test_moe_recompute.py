"""An MoE llama layer under ``model.recompute=full`` on ep2 (docs/moe.md): the backward's
re-run of the forward exchanges the tokens again, and the bytes a rank counts over its expert
group are exactly ``hybrid-plan``'s prediction (``moe_traffic.a2a_step_bytes``, which adds
the recompute's forward exchange), as they are without recompute; the layer's step figures
count each slot once either way (``tests/test_expert_bias.py`` shows them equal in one
process)."""

from dataclasses import replace

import pytest
import torch

from test_llama import preset

SEQ, BATCH = 8, 2
"""One micro-batch of a rank: ``SEQ x BATCH`` tokens."""


def test_the_recomputed_exchange_is_counted_as_the_plan_predicts():
    from hybrid.planning.config import Config, ParallelConfig, TrainConfig
    from hybrid.planning.cost.moe_traffic import a2a_step_bytes
    from hybrid.planning.layout import Layout
    from hybrid.testing import spawn

    layout = Layout(dp=2, ep=2)
    for recompute in ("none", "full"):
        model = replace(preset("moe-tiny"), seq_len=SEQ, recompute=recompute)
        cfg = Config(model=model, train=TrainConfig(micro_batch=BATCH),
                     parallel=ParallelConfig(dp=2, ep=2))
        predicted = a2a_step_bytes(cfg, layout, moe_layers=1, microbatches=1)
        for rank in spawn(_exchange, 2, recompute):
            assert rank["ep_bytes"] == predicted, (recompute, rank["ep_bytes"], predicted)
            assert rank["tokens_per_expert"] == [SEQ * BATCH // 2] * 4  # even, counted once
    forward_only = 2 * 8 + SEQ * BATCH * 32 * (4 + 4)  # counts, half the slots both ways
    assert predicted == a2a_step_bytes(replace(cfg, model=replace(model, recompute="none")),
                                       layout, 1, 1) + forward_only


def _exchange(rank, world, recompute: str) -> dict:
    """One micro-batch's forward and backward through an MoE layer routing evenly (token
    ``t`` to experts ``2t % 4`` and ``2t % 4 + 1``): the expert group's bytes counted, and the
    layer's kept slots per expert."""
    from hybrid.comm import CommCounter
    from hybrid.groups import ParallelGroups
    from hybrid.model.llama import LlamaLayer
    from hybrid.model.moe import moe_step_stats
    from hybrid.planning.layout import Layout

    groups = ParallelGroups.create(Layout(dp=2, ep=2))
    cfg = replace(preset("moe-tiny"), seq_len=SEQ, recompute=recompute)
    layer = LlamaLayer(cfg, groups.tensor, generator=torch.Generator().manual_seed(0),
                       sequence_parallel=False, expert_group=groups.expert)
    with torch.no_grad():
        layer.attention.proj.weight.zero_()  # the MLP's input is the layer's input
        layer.mlp.router.weight.zero_()
        layer.mlp.router.weight[:, :4] = torch.eye(4)  # logit e = hidden dim e
    hidden = torch.rand(SEQ, BATCH, cfg.hidden, generator=torch.Generator().manual_seed(rank))
    hidden[..., :4] = 0.0
    first = 2 * (torch.arange(SEQ * BATCH).view(SEQ, BATCH) % 2)  # expert pairs 0-1, 2-3
    hidden[..., :4].scatter_(-1, torch.stack((first, first + 1), dim=-1), 4.0)
    counter = CommCounter(groups)
    with counter.track():
        layer(hidden.requires_grad_()).sum().backward()
    return {"ep_bytes": counter.snapshot()["ep"]["bytes"],
            "tokens_per_expert": moe_step_stats([layer])["tokens_per_expert"]}


def test_the_step_time_prices_the_recomputed_exchange_in_the_backward():
    from hybrid.planning.config import Config, ParallelConfig
    from hybrid.planning.cost.devices import load_device
    from hybrid.planning.cost.stage_time import stage_times
    from hybrid.planning.job import plan_job

    device, blocks = load_device("cpu"), range(1, preset("moe-tiny").layers + 1)
    times = {}
    for recompute in ("none", "full"):
        model = replace(preset("moe-tiny"), recompute=recompute)
        for ep in (1, 2):
            plan = plan_job(Config(model=model, parallel=ParallelConfig(dp=2, ep=ep)))
            times[recompute, ep] = stage_times(plan, device, blocks)
    exchange_forward = times["none", 2].forward - times["none", 1].forward
    assert exchange_forward > 0
    assert times["full", 2].forward - times["full", 1].forward == exchange_forward
    backward = {r: times[r, 2].backward - times[r, 1].backward for r in ("none", "full")}
    assert backward["full"] - backward["none"] == \
        pytest.approx(exchange_forward, rel=1e-12)
