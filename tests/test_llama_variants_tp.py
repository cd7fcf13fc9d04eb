"""The llama family's variants under tensor and context parallelism against the 1-process model.

One 2-process job: each variant (Llama 3's rope scaling, Qwen2's q/k/v biases with grouped
queries, Qwen3's head_dim and q/k norms, Mistral's window) at tp=2, with and without sequence
parallelism: its weights are bitwise slices of the 1-process model's, its loss and every
gradient match (fp32). One 4-process job: the sliding window's context attention (cp 2 and 4,
p2p and all-gather, zigzag or not) against full windowed attention, outputs and gradients."""

import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from hybrid.groups import ParallelGroups
from hybrid.model import GPT, allreduce_sequence_parallel_grads, gather_tp_param
from hybrid.model.context import context_attention, context_slice, window_mask
from hybrid.planning.config import ModelConfig
from hybrid.planning.layout import Layout
from hybrid.testing import spawn

pytestmark = pytest.mark.timeout(240)

TINY = dict(family="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48,
            vocab=120, vocab_pad_multiple=64, seq_len=16)
VARIANTS = {
    "llama3": dict(rope_scaling="llama3", rope_factor=8.0, rope_original_positions=8),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(head_dim=16, qk_norm=True),
    "qwen3-mha": dict(head_dim=6, qk_norm=True, kv_heads=4, qkv_bias=True),
    "mistral": dict(sliding_window=5),
}
CASES = [(name, sp) for name in VARIANTS for sp in (False, True)]
SEED, BATCH, SEQ = 7, 2, 16


def _batch():
    gen = torch.Generator().manual_seed(1000)
    tokens = torch.randint(0, TINY["vocab"], (BATCH, SEQ), generator=gen)
    return tokens, torch.randint(0, TINY["vocab"], (BATCH, SEQ), generator=gen)


def _loss_and_backward(model: GPT, tokens, labels) -> float:
    loss = model(tokens, labels)
    loss.backward()
    # Partial over TP: norms under sequence parallelism, and Qwen3's q/k norms always (each
    # rank sees its heads); the DP sync sums them (``dp.buckets.reduce_first_axis``).
    allreduce_sequence_parallel_grads(model.blocks, model.groups.tensor)
    return loss.item()


def _one_case(cfg: ModelConfig, sp: bool, reference_groups, groups) -> dict:
    reference = GPT(cfg, reference_groups, seed=SEED)
    parallel = GPT(cfg, groups, seed=SEED, sequence_parallel=sp)
    ref_params = dict(reference.named_parameters())
    init_mismatch = [name for name, p in parallel.named_parameters()
                     if not torch.equal(gather_tp_param(p.detach(), p, groups), ref_params[name])]
    tokens, labels = _batch()
    losses = (_loss_and_backward(parallel, tokens, labels),
              _loss_and_backward(reference, tokens, labels))
    grads = {}
    for name, p in parallel.named_parameters():
        diff = gather_tp_param(p.grad, p, groups).double() - ref_params[name].grad.double()
        grads[name] = (diff.norm() / ref_params[name].grad.double().norm()).item()
    return {"init_mismatch": init_mismatch, "losses": losses, "grads": grads,
            "names": sorted(ref_params)}


def _tp_job(rank, world):
    reference = ParallelGroups.create(Layout())
    groups = ParallelGroups.create(Layout(tp=2))
    return {(name, sp): _one_case(ModelConfig(**{**TINY, **VARIANTS[name]}), sp, reference,
                                  groups)
            for name, sp in CASES}


@pytest.fixture(scope="module")
def results():
    return spawn(_tp_job, 2, timeout=200)


@pytest.mark.parametrize("name, sp", CASES)
def test_weights_are_bitwise_slices_and_losses_and_gradients_match(results, name, sp):
    for rank in results:
        case = rank[(name, sp)]
        assert case["init_mismatch"] == []
        ours, reference = case["losses"]
        assert ours == pytest.approx(reference, rel=1e-6)
        worst = max(case["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst


def test_the_variants_features_are_parameters_of_the_model(results):
    names = {name: results[0][(name, False)]["names"] for name in VARIANTS}
    assert "blocks.1.attention.qkv.bias" in names["qwen2"]
    assert "blocks.1.attention.q_norm.weight" in names["qwen3"]
    assert names["llama3"] == names["mistral"]  # no parameters of their own


B, HEADS, WSEQ, HD = 2, 3, 24, 8
WINDOW_CASES = list(itertools.product((2, 4), ("p2p", "allgather"), (True, False), (1, 4, 7)))


def _split(t, cp, rank, zigzag):
    return context_slice(t.transpose(1, 2), cp, rank, zigzag).transpose(1, 2)


def _window_job(rank, world):
    g = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(B, HEADS, WSEQ, HD, generator=g) for _ in range(4))
    errors = {}
    for cp, comm, zigzag, window in WINDOW_CASES:
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        positions = torch.arange(WSEQ)
        want = F.scaled_dot_product_attention(*full, attn_mask=window_mask(positions, positions,
                                                                           window))
        want.backward(grad)
        want = (want, *(t.grad for t in full))
        groups = ParallelGroups.create(Layout(cp=cp))
        rank = groups.context.rank()
        mine = [_split(t, cp, rank, zigzag).clone().requires_grad_() for t in (q, k, v)]
        out = context_attention(*mine, groups.context, comm=comm, zigzag=zigzag, window=window)
        out = out.view(WSEQ // cp, B, HEADS, HD).permute(1, 2, 0, 3)
        out.backward(_split(grad, cp, rank, zigzag))
        got = (out, *(t.grad for t in mine))
        errors[(cp, comm, zigzag, window)] = max(
            (a - _split(w, cp, rank, zigzag)).abs().max().item() for a, w in zip(got, want))
        groups.destroy()
    return errors


@pytest.fixture(scope="module")
def window_errors():
    return spawn(_window_job, 4, timeout=200)


@pytest.mark.slow
@pytest.mark.parametrize("cp, comm, zigzag, window", WINDOW_CASES)
def test_windowed_context_attention_equals_full_windowed_attention(window_errors, cp, comm,
                                                                   zigzag, window):
    worst = max(rank_errors[(cp, comm, zigzag, window)] for rank_errors in window_errors)
    assert worst < 1e-5, worst
