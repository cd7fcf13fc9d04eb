"""AdamW weight-decay groups, the LR schedule and bucket planning: no processes."""

import math

import pytest
import torch
from torch import nn

from hybrid.errors import UserError
from hybrid.planning.config import ModelConfig, OptimConfig
from hybrid.dp import plan_buckets
from hybrid.planning.params import model_param_specs
from hybrid.optim import (
    build_adamw, lr_at, optimizer_state_bytes, spec_of, step_count, unique_parameters,
)

OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=4)


def test_lr_warms_up_linearly_then_follows_a_cosine_to_min_lr():
    total = 14
    lrs = [lr_at(step, OPTIM, total) for step in range(1, total + 1)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    middle = 4 + (total - 4) // 2  # half-way through the decay: half-way between the ends
    assert lr_at(middle, OPTIM, total) == pytest.approx((1e-3 + 1e-4) / 2)
    assert lrs[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lr_at(total + 5, OPTIM, total) == pytest.approx(1e-4)  # past the end: min_lr
    no_warmup = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0)
    assert lr_at(1, no_warmup, 3) == pytest.approx(0.5 * (1 + math.cos(math.pi / 3)))


def test_lr_at_rejects_zero_based_steps():
    with pytest.raises(ValueError, match="1-based"):
        lr_at(0, OPTIM, 10)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.position_embeddings = nn.Parameter(torch.zeros(4, 8))
        self.word = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)


def test_plain_modules_decay_their_matrices_only():
    decays = {name: spec_of(p, name).weight_decay for name, p in Tiny().named_parameters()}
    assert decays == {"position_embeddings": True, "word.weight": True, "norm.weight": False,
                      "norm.bias": False, "proj.weight": True, "proj.bias": False}


def test_gpt_specs_decay_matrices_but_not_the_position_table_norms_or_biases():
    specs = model_param_specs(ModelConfig(layers=2))
    decayed = sorted(name for name, spec in specs.items() if spec.weight_decay)
    assert decayed == ["blocks.1.attention.proj.weight", "blocks.1.attention.qkv.weight",
                       "blocks.1.mlp.fc1.weight", "blocks.1.mlp.fc2.weight",
                       "blocks.2.attention.proj.weight", "blocks.2.attention.qkv.weight",
                       "blocks.2.mlp.fc1.weight", "blocks.2.mlp.fc2.weight",
                       "embedding.word_embeddings.weight", "head.output_layer.weight"]


def test_adamw_groups_and_exact_state_bytes():
    model = Tiny()
    named = unique_parameters([model])
    optimizer = build_adamw([(p, spec.weight_decay) for spec, p in named], OPTIM)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [OPTIM.weight_decay, 0.0]
    assert len(optimizer.param_groups[0]["params"]) == 3
    sum(p.sum() for p in model.parameters()).backward()
    optimizer.step()
    numel = sum(p.numel() for p in model.parameters())
    assert optimizer_state_bytes(optimizer) == {"per_element": 2 * 4 * numel,
                                                "scalars": 4 * len(named)}
    with pytest.raises(UserError, match="optim.name=adamw"):
        build_adamw([], OptimConfig(name="sgd"))
    with pytest.raises(UserError, match="optim.implementation='apex' is unknown"):
        build_adamw([], OptimConfig(implementation="apex"))


@pytest.mark.parametrize("implementation", ["foreach", "for-loop"])
def test_every_adamw_implementation_makes_the_fused_update(implementation):
    """fused (the default) and the others: the same parameters and moments after a few
    steps, up to rounding; a loaded step count goes where each keeps its own."""
    results = {}
    for name in ("fused", implementation):
        torch.manual_seed(0)
        model = Tiny()
        named = unique_parameters([model])
        optimizer = build_adamw([(p, spec.weight_decay) for spec, p in named],
                                OptimConfig(lr=1e-2, implementation=name))
        assert optimizer.defaults["fused"] is (True if name == "fused" else None)
        for step in range(3):
            model.zero_grad()
            (sum((p * (step + 1)).sin().sum() for p in model.parameters())).backward()
            optimizer.step()
        states = [optimizer.state[p] for p in model.parameters()]
        results[name] = [t.detach().clone() for p, st in zip(model.parameters(), states)
                         for t in (p, st["exp_avg"], st["exp_avg_sq"])]
        count = step_count(torch.tensor(3.0), next(model.parameters()), optimizer)
        assert count.dtype == torch.float32 and count.device.type == "cpu"
    assert OptimConfig().implementation == "fused"
    for got, want in zip(results[implementation], results["fused"]):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


def test_tied_parameters_are_listed_once_and_chunks_are_prefixed():
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    second.weight = first.weight
    names = [spec.name for spec, _ in unique_parameters([first, second])]
    assert names == ["0.weight", "0.bias", "1.bias"]


def test_buckets_close_once_they_reach_the_size_in_backward_order():
    params = [torch.zeros(n) for n in (10, 20, 5, 30, 1)]
    sizes = [[p.numel() for p in b] for b in plan_buckets(params, bucket_bytes=4 * 25)]
    assert sizes == [[10, 20], [5, 30], [1]]
