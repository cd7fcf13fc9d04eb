"""Vocab-parallel cross entropy over a padded vocabulary: the padding columns are masked, so
the loss is torch's cross entropy over the real vocabulary at every TP size (even where one
rank's whole slice is padding), and the padding logits get exactly zero gradient."""

import pytest
import torch
import torch.nn.functional as F

from hybrid.groups import ParallelGroups
from hybrid.model.cross_entropy import vocab_parallel_cross_entropy
from hybrid.planning.layout import Layout
from hybrid.testing import spawn

VOCAB, PADDED = 90, 128  # tp=4: rank 3's slice (96..127) is all padding, rank 2's holds 6


def _case(rank, world):
    groups = ParallelGroups.create(Layout(tp=world))
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(5, 2, PADDED, generator=gen) * 4
    target = torch.randint(0, VOCAB, (5, 2), generator=gen)
    width = PADDED // world
    shard = full[..., rank * width:(rank + 1) * width].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, groups.tensor, VOCAB)
    loss.sum().backward()
    real = full[..., :VOCAB].clone().requires_grad_()
    reference = F.cross_entropy(real.reshape(-1, VOCAB), target.reshape(-1),
                                reduction="none").view(5, 2)
    reference.sum().backward()
    grad = torch.zeros(5, 2, PADDED)
    grad[..., :VOCAB] = real.grad
    return {"loss": (loss - reference).abs().max().item(),
            "grad": (shard.grad - grad[..., rank * width:(rank + 1) * width]).abs().max().item(),
            "padding_grad_zero": bool((shard.grad[..., max(VOCAB - rank * width, 0):] == 0)
                                      .all()),
            "finite": bool(torch.isfinite(shard.grad).all())}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_padding_is_masked_at_every_tp_size(tp):
    for rank, out in enumerate(spawn(_case, tp, timeout=100)):
        assert out["loss"] < 1e-5 and out["grad"] < 1e-6, (rank, out)
        assert out["padding_grad_zero"] and out["finite"], (rank, out)
