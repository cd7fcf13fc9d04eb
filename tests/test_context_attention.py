"""Context-parallel attention alone against full causal attention (fp32, 1e-6).

One 4-process job runs every case: cp=2 (two independent groups) and cp=4, keys and values
passed around the ring (p2p) or all-gathered, with and without the zigzag split. Every rank
computes the full attention of the same inputs and compares its own slice of the output and of
the gradients of q, k and v.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from hybrid.groups import ParallelGroups
from hybrid.model.context import context_attention, context_positions, context_slice
from hybrid.planning.context import local_positions
from hybrid.planning.layout import Layout
from hybrid.testing import spawn

pytestmark = pytest.mark.timeout(180)

B, HEADS, SEQ, HD = 2, 3, 24, 8
CASES = list(itertools.product((2, 4), ("p2p", "allgather"), (True, False)))


def _inputs():
    g = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(B, HEADS, SEQ, HD, generator=g) for _ in range(4))
    return q, k, v, grad


def _full(q, k, v, grad):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(grad)
    return out, q.grad, k.grad, v.grad


def _split(t, cp, rank, zigzag):
    return context_slice(t.transpose(1, 2), cp, rank, zigzag).transpose(1, 2)


def _job(rank, world):
    q, k, v, grad = _inputs()
    want = _full(q, k, v, grad)
    errors = {}
    for cp, comm, zigzag in CASES:
        groups = ParallelGroups.create(Layout(cp=cp))
        rank = groups.context.rank()
        mine = [_split(t, cp, rank, zigzag).clone().requires_grad_() for t in (q, k, v)]
        out = context_attention(*mine, groups.context, comm=comm, zigzag=zigzag)
        out = out.view(SEQ // cp, B, HEADS, HD).permute(1, 2, 0, 3)  # [s, b, n*hd] -> like q
        out.backward(_split(grad, cp, rank, zigzag))
        got = (out, *(t.grad for t in mine))
        errors[(cp, comm, zigzag)] = max(
            (g - _split(w, cp, rank, zigzag)).abs().max().item() for g, w in zip(got, want))
        groups.destroy()
    return errors


@pytest.fixture(scope="module")
def errors():
    return spawn(_job, 4, timeout=150)


@pytest.mark.slow
@pytest.mark.parametrize("cp,comm,zigzag", CASES)
def test_context_attention_equals_full_causal_attention(errors, cp, comm, zigzag):
    worst = max(rank_errors[(cp, comm, zigzag)] for rank_errors in errors)
    assert worst <= 1e-6, worst


@pytest.mark.parametrize("cp,rank", [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_a_ranks_tokens_and_positions_are_its_zigzag_chunks(cp, rank):
    tokens = torch.arange(16).unsqueeze(0)
    mine = context_slice(tokens, cp, rank)
    assert mine.tolist()[0] == local_positions(16, cp, rank)
    assert context_positions(16 // cp, cp, rank, torch.device("cpu")).tolist() == \
        local_positions(16, cp, rank)
    if cp == 4 and rank == 3:
        assert mine.tolist()[0] == [6, 7, 8, 9]  # chunks 3 and 4 of 8


@pytest.mark.parametrize("causal", [True, False])
def test_the_plain_matmul_blocks_equal_the_fused_kernel(causal):
    """Off CPU the blocks run in plain matmuls (the CUDA path, never run here): each block's
    output, log-sum-exp and gradients (against a merged row) equal the CPU kernel's."""
    from hybrid.model.context import _block_backward, _block_forward, _merge

    g = torch.Generator().manual_seed(5)
    q, k1, v1, k2, v2, grad = (torch.randn(2, 3, 8, 4, generator=g) for _ in range(6))
    results = []
    for fused in (True, False):
        first = _block_forward(q, k1, v1, causal, fused=fused)
        out, lse = _merge(*first, *_block_forward(q, k2, v2, False, fused=fused))
        grads = [_block_backward(q, k, v, grad, out, lse, c, fused=fused)
                 for k, v, c in ((k1, v1, causal), (k2, v2, False))]
        results.append([out, lse, *(t for block in grads for t in block)])
    for fused, plain in zip(*results):
        assert (fused - plain).abs().max() <= 1e-6
