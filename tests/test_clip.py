"""Global gradient norm and the other-axis reductions (sequence-parallel over TP, tied embedding
over the first and last stage), with and without ZeRO-1, against the 1-process gradient.

A ``Probe`` holds this rank's part of a few logical parameters of a "1-process model": TP
shards, TP-replicated tensors, sequence-parallel norms (partial gradients per TP rank) and a
tied embedding with a copy on the last stage. Its loss is linear, so each gradient is a known
coefficient; the test builds the 1-process gradient from the coefficients and compares.
"""

import math

import pytest
import torch
from torch import nn

from hybrid.planning.config import OptimConfig
from hybrid.dp import GradSync
from hybrid.groups import ParallelGroups
from hybrid.planning.layout import Layout
from hybrid.planning.params import ParamSpec
from hybrid.testing import spawn

pytestmark = pytest.mark.timeout(180)

OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=0, weight_decay=0.1)
# name -> (full shape, TP partition dim or None, extra attributes)
STAGE_PARAMS = {
    "w": ((4, 6), 0, {}),
    "v": ((6, 4), 1, {}),
    "b": ((4,), None, {}),
    "ln": ((6,), None, {"sequence_partial": True}),
}
EMBEDDING = ((8, 6), 0, {"tied": True})


def coefficient(name: str, stage: int, shape) -> torch.Tensor:
    seed = sum(map(ord, name)) * 10 + stage
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def stage_specs(groups) -> dict:
    specs = {f"{name}{groups.pp_rank}": spec for name, spec in STAGE_PARAMS.items()}
    if groups.is_first_stage:
        specs["emb"] = EMBEDDING
    elif groups.is_last_stage:
        specs["head"] = EMBEDDING  # the last stage's copy of the tied embedding
    return specs


def local_part(full: torch.Tensor, dim, groups) -> torch.Tensor:
    if dim is None:
        return full
    return full.chunk(groups.layout.tp, dim)[groups.tp_rank].clone()


class Probe(nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.groups, self.specs = groups, stage_specs(groups)
        for name, (shape, dim, attrs) in self.specs.items():
            param = nn.Parameter(local_part(torch.zeros(shape), dim, groups))
            param.spec = ParamSpec(name=name, shape=shape, tp_dim=dim, **attrs)
            self.register_parameter(name, param)

    def loss(self) -> torch.Tensor:
        """Gradient of each parameter: its coefficient x (dp_rank + 1), and x (tp_rank + 1)
        for sequence-parallel ones (a partial sum per TP rank)."""
        total = 0
        for name, (shape, dim, attrs) in self.specs.items():
            coeff = local_part(coefficient(name.rstrip("0123456789"), self.groups.pp_rank,
                                           shape), dim, self.groups)
            if attrs.get("sequence_partial"):
                coeff = coeff * (self.groups.tp_rank + 1)
            total = total + (getattr(self, name) * coeff).sum()
        return total * (self.groups.data.rank() + 1)


def one_process_norm(layout: Layout) -> float:
    dp_mean = (layout.dp + 1) / 2
    tp_sum = sum(t + 1 for t in range(layout.tp))
    squares = 0.0
    for stage in range(layout.pp):
        for name, (shape, _, attrs) in STAGE_PARAMS.items():
            factor = tp_sum if attrs.get("sequence_partial") else 1
            squares += (coefficient(name, stage, shape) * factor).square().sum().item()
    embedding = coefficient("emb", 0, EMBEDDING[0])
    if layout.pp > 1:
        embedding = embedding + coefficient("head", layout.pp - 1, EMBEDDING[0])
    squares += embedding.square().sum().item()
    return math.sqrt(squares) * dp_mean


def _norms(rank, world):
    out = {}
    for kwargs in ({"dp": 2, "tp": 2}, {"dp": 2, "pp": 2}):
        groups = ParallelGroups.create(Layout(**kwargs))
        models = {}
        for zero in (0, 1):
            model = Probe(groups)
            sync = GradSync(model, groups, OPTIM, bucket_mb=1e-4, zero=zero)
            sync.start_step(1)
            model.loss().backward()
            sync.reduce_gradients()
            norm = sync.clip_grad_norm_(max_norm=1.0)
            after_clip = sync.clip_grad_norm_(max_norm=0.0)  # 0 disables: just measures
            sync.optimizer_step(lr=1e-2)
            late = len(sync.buckets) - sync.num_overlapped
            out[(str(kwargs), zero)] = (norm, after_clip, late, sync.launched_in_backward)
            models[zero] = model
        out[(str(kwargs), "params_equal")] = all(
            torch.allclose(a, b, rtol=1e-6, atol=1e-7)
            for a, b in zip(models[0].parameters(), models[1].parameters()))
    return out


def test_global_norm_counts_every_element_of_the_one_process_model_once():
    results = spawn(_norms, 4)
    for kwargs, late_buckets in (({"dp": 2, "tp": 2}, 1), ({"dp": 2, "pp": 2}, 1)):
        expected = one_process_norm(Layout(**kwargs))
        for rank, out in enumerate(results):
            for zero in (0, 1):
                norm, after_clip, late, _ = out[(str(kwargs), zero)]
                assert norm == pytest.approx(expected, rel=1e-6), (kwargs, zero, rank)
                assert after_clip == pytest.approx(1.0, rel=1e-5)  # clipped to max_norm=1
                assert late == late_buckets  # SP norms over TP / tied embedding over stages
            assert out[(str(kwargs), "params_equal")], "ZeRO-1 step differs from plain DP"
