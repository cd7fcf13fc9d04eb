"""DP gradient sync on gloo: parity with the 1-process model, traffic, other-axis reductions."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybrid.comm import CommCounter
from hybrid.planning.config import OptimConfig
from hybrid.dp import GradSync
from hybrid.groups import ParallelGroups
from hybrid.planning.layout import Layout
from hybrid.optim import build_adamw, lr_at, set_lr, spec_of
from hybrid.testing import spawn

pytestmark = pytest.mark.timeout(180)

OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, weight_decay=0.1)
CLIP = 0.3
MICRO = 2  # samples per micro-batch
TINY_BUCKETS_MB = 0.001  # ~1 KiB: the toy model spreads over three buckets


class Toy(nn.Module):
    """A position table, two linears and a norm: every kind of weight-decay group."""

    def __init__(self, seed: int = 0, width: int = 16, hidden: int = 32):
        super().__init__()
        torch.manual_seed(seed)
        self.position = nn.Parameter(0.1 * torch.randn(4, width))
        self.inp = nn.Linear(width, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, width)

    def forward(self, x, y):
        hidden = torch.tanh(self.inp(x + self.position))
        return F.mse_loss(self.out(self.norm(hidden)), y)


def global_batch(step: int, samples: int, width: int = 16):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(samples, 4, width, generator=gen)
    return x, torch.sin(x) + 0.1 * torch.randn(samples, 4, width, generator=gen)


def micro_loss(model, x, y, bf16: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return model(x, y).float()


def reference_step(model, optimizer, x, y, microbatches, lr, bf16=False):
    """The 1-process model on the whole global batch, in the same micro-batch pieces."""
    losses = []
    for chunk in range(microbatches):
        rows = slice(chunk * MICRO, (chunk + 1) * MICRO)
        loss = micro_loss(model, x[rows], y[rows], bf16)
        (loss / microbatches).backward()
        losses.append(loss.item())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
    set_lr(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad()
    return sum(losses) / len(losses), norm


def _train_against_reference(rank, world, zero, bf16, microbatches, steps):
    groups = ParallelGroups.create(Layout(dp=world))
    model = Toy()
    ref = copy.deepcopy(model)
    ref_opt = build_adamw([(p, spec_of(p, n).weight_decay) for n, p in ref.named_parameters()],
                          OPTIM)
    sync = GradSync(model, groups, OPTIM, bucket_mb=TINY_BUCKETS_MB, zero=zero)
    out = {"loss": [], "ref_loss": [], "norm": [], "ref_norm": [], "in_backward": []}
    for step in range(1, steps + 1):
        x, y = global_batch(step, world * microbatches * MICRO)
        lr = lr_at(step, OPTIM, steps)
        sync.start_step(microbatches)
        losses = []
        for chunk in range(microbatches):
            rows = slice((rank * microbatches + chunk) * MICRO,
                         (rank * microbatches + chunk + 1) * MICRO)
            loss = micro_loss(model, x[rows], y[rows], bf16)
            (loss / microbatches).backward()
            losses.append(loss.item())
        out["in_backward"].append(sync.launched_in_backward)
        out["norm"].append(sync.finish_step(lr=lr, max_norm=CLIP))
        out["loss"].append(sum(losses) / len(losses))
        ref_loss, ref_norm = reference_step(ref, ref_opt, x, y, world * microbatches, lr, bf16)
        out["ref_loss"].append(ref_loss)
        out["ref_norm"].append(ref_norm)
    out["param_mismatch"] = [n for (n, p), r in zip(model.named_parameters(), ref.parameters())
                             if not torch.allclose(p, r, rtol=1e-5, atol=1e-7)]
    out["overlapped_buckets"] = sync.num_overlapped
    out["fp32_buffers"] = all(b.grad.dtype == torch.float32 for b in sync.buckets)
    return out


@pytest.mark.parametrize("world,zero,bf16", [(2, 0, False), (4, 0, False), (2, 1, False),
                                             (4, 1, False), (2, 1, True), (4, 2, False),
                                             (2, 2, True)])
def test_dp_training_matches_one_process_on_the_global_batch(world, zero, bf16):
    """Several micro-batches per step, with and without ZeRO-1/2; bf16: autocast compute,
    fp32 master weights and fp32 gradient buffers, against the same autocast 1-process run.
    ZeRO-2 reduce-scatters each micro-batch as its backward makes it."""
    steps, microbatches = 10, 3
    results = spawn(_train_against_reference, world, zero, bf16, microbatches, steps)
    ref_loss = results[0]["ref_loss"]
    dp_loss = [sum(r["loss"][s] for r in results) / world for s in range(steps)]
    torch.testing.assert_close(dp_loss, ref_loss, rtol=1e-5, atol=0)
    for r in results:
        torch.testing.assert_close(r["norm"], r["ref_norm"], rtol=1e-5, atol=0)
        assert r["param_mismatch"] == []
        assert r["fp32_buffers"]
        # Every bucket started during the last micro-batch's backward: overlap, not at the end.
        assert r["overlapped_buckets"] == 3
        assert r["in_backward"] == [0 if zero == 2 else 3] * steps
    assert any(n > CLIP for n in results[0]["norm"]), "clipping was never exercised"
    assert ref_loss[-1] < ref_loss[0]


def _dp_traffic(rank, world, microbatches, zero):
    groups = ParallelGroups.create(Layout(dp=2, tp=2))
    model = Toy()
    unit_model = copy.deepcopy(model)
    x, y = torch.ones(MICRO, 4, 16), torch.zeros(MICRO, 4, 16)
    unit_model(x, y).backward()
    sync = GradSync(model, groups, OPTIM, bucket_mb=TINY_BUCKETS_MB, zero=zero)
    counter = CommCounter(groups)
    sync.start_step(microbatches)
    with counter.track():  # one whole optimizer step
        for _ in range(microbatches):
            # A gradient scaled by the global rank: the reduced value shows who took part.
            (model(x, y) * (rank + 1) / microbatches).backward()
        sync.reduce_gradients()
        reduced = model.out.bias.grad.clone()  # (under ZeRO-1 only this rank's shard is)
        sync.clip_grad_norm_(CLIP)
        sync.optimizer_step(lr=1e-3)
        sync.zero_grad()
    members = groups.gradient.ranks
    expected = unit_model.out.bias.grad * sum(m + 1 for m in members) / len(members)
    error = (reduced - expected).abs().max().item()
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    return counter.snapshot(), grad_bytes, error, members


@pytest.mark.parametrize("zero", [0, 1])
def test_dp_traffic_is_one_ring_all_reduce_in_the_dp_group_per_step(zero):
    """DP bytes per step = 2(d-1)/d x the rank's gradient bytes, whatever the micro-batch
    count: an all-reduce, or under ZeRO-1 a reduce-scatter plus an all-gather (the buckets of
    this model need no padding), plus ZeRO's 8-byte all-reduce of the squared norm."""
    layout, d = Layout(dp=2, tp=2), 2
    by_microbatches = {m: spawn(_dp_traffic, 4, m, zero) for m in (1, 4)}
    for rank, (counts, grad_bytes, error, members) in enumerate(by_microbatches[1]):
        norm_bytes, norm_calls = (2 * (d - 1) / d * 8, 1) if zero else (0, 0)
        assert counts["dp"]["bytes"] == pytest.approx(2 * (d - 1) / d * grad_bytes + norm_bytes)
        assert counts["dp"]["calls"] == 3 * (2 if zero else 1) + norm_calls  # 3 buckets
        assert counts["tp"]["calls"] == counts["pp"]["calls"] == 0
        assert counts["other"]["calls"] == 1  # the squared norm over tp-pp
        assert members == layout.group_of("dp", rank)
        if not zero:
            assert error < 1e-6, "the gradient is not the mean over exactly this DP group"
        assert by_microbatches[4][rank][0] == counts, "DP traffic grew with micro-batches"


GPT_CFG = dict(layers=2, hidden=32, heads=4, vocab=120, vocab_pad_multiple=64, seq_len=16,
               tie_embeddings=True)


def _gpt_against_reference(rank, world, tp, sp, zero, steps, microbatches):
    from hybrid.planning.config import ModelConfig
    from hybrid.model import GPT, gather_tp_param

    cfg = ModelConfig(**GPT_CFG)
    groups = ParallelGroups.create(Layout(dp=world // tp, tp=tp))
    model = GPT(cfg, groups, seed=7, sequence_parallel=sp)
    ref = GPT(cfg, ParallelGroups.create(Layout()), seed=7)
    ref_opt = build_adamw([(p, spec_of(p, n).weight_decay) for n, p in ref.named_parameters()],
                          OPTIM)
    sync = GradSync(model, groups, OPTIM, bucket_mb=0.01, zero=zero)
    dp, out = world // tp, {"loss": [], "ref_loss": [], "norm": [], "ref_norm": []}
    for step in range(1, steps + 1):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, cfg.vocab, (dp * microbatches * MICRO, cfg.seq_len + 1),
                               generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        lr = lr_at(step, OPTIM, steps)
        sync.start_step(microbatches)
        losses = []
        for chunk in range(microbatches):
            first = (groups.data.rank() * microbatches + chunk) * MICRO
            loss = model(x[first:first + MICRO], y[first:first + MICRO])
            (loss / microbatches).backward()
            losses.append(loss.item())
        out["norm"].append(sync.finish_step(lr=lr, max_norm=CLIP))
        out["loss"].append(sum(losses) / microbatches)
        ref_loss, ref_norm = reference_step(ref, ref_opt, x, y, dp * microbatches, lr)
        out["ref_loss"].append(ref_loss)
        out["ref_norm"].append(ref_norm)
    # atol (lr / 200): where the true gradient is ~0 (the attention key bias: softmax ignores a
    # shift shared by all keys) AdamW scales rounding noise up to ~1e-6 (tp=1) or ~1e-5 (tp=2,
    # which reorders sums); every other element agrees to rtol.
    out["param_mismatch"] = [
        name for (name, p), r in zip(model.named_parameters(), ref.parameters())
        if not torch.allclose(gather_tp_param(p.detach(), p, groups), r, rtol=1e-4, atol=5e-5)]
    replicated = [p for p in model.parameters() if p.spec.tp_dim is None]
    copies = [[torch.empty_like(p) for _ in range(tp)] for p in replicated]
    for p, shards in zip(replicated, copies):
        groups.tensor.all_gather(shards, p.detach().contiguous())
    out["tp_replicas_identical"] = all(torch.equal(c, p) for p, shards in zip(replicated, copies)
                                       for c in shards)
    out["dp_rank"], out["late"] = groups.data.rank(), len(sync.buckets) - sync.num_overlapped
    out["overlap"] = (sync.launched_in_backward, sync.num_overlapped)
    return out


@pytest.mark.parametrize("world,tp,sp,zero", [(2, 1, False, 0), (4, 2, True, 1)])
def test_gpt_with_dp_matches_the_one_process_gpt(world, tp, sp, zero):
    steps, microbatches = 4, 2
    results = spawn(_gpt_against_reference, world, tp, sp, zero, steps, microbatches)
    dp = world // tp
    per_dp = {r["dp_rank"]: r["loss"] for r in results}
    dp_loss = [sum(per_dp[d][s] for d in range(dp)) / dp for s in range(steps)]
    rtol = 1e-5 if tp == 1 else 1e-4  # TP changes the order of sums inside the model
    torch.testing.assert_close(dp_loss, results[0]["ref_loss"], rtol=rtol, atol=0)
    for r in results:
        torch.testing.assert_close(r["norm"], r["ref_norm"], rtol=rtol, atol=0)
        assert r["param_mismatch"] == []
        assert r["tp_replicas_identical"]
        assert r["late"] == (1 if sp else 0)  # the sequence-parallel norms, summed over TP
        launched_in_backward, overlapped = r["overlap"]
        assert launched_in_backward == overlapped > 1


def _misuse(rank, world):
    from hybrid.dp import DataParallelConfigError

    groups = ParallelGroups.create(Layout())
    x, y = torch.ones(MICRO, 4, 16), torch.zeros(MICRO, 4, 16)
    errors = {}

    def expect(key, error, action):
        try:
            action()
        except error as exc:
            errors[key] = str(exc)

    expect("zero", DataParallelConfigError, lambda: GradSync(Toy(), groups, OPTIM, zero=4))
    expect("bucket", DataParallelConfigError, lambda: GradSync(Toy(), groups, OPTIM, bucket_mb=0))
    expect("bf16", DataParallelConfigError,
           lambda: GradSync(Toy().to(torch.bfloat16), groups, OPTIM))
    model = Toy()
    sync = GradSync(model, groups, OPTIM)
    expect("count", DataParallelConfigError, lambda: sync.start_step(0))
    expect("outside", RuntimeError, lambda: model(x, y).backward())
    sync.start_step(1)
    expect("twice", RuntimeError, lambda: sync.start_step(1))
    model(x, y).backward()
    expect("too_many", RuntimeError, lambda: model(x, y).backward())
    model = Toy()
    sync = GradSync(model, groups, OPTIM)
    model.zero_grad()  # set_to_none: breaks the bucket views
    sync.start_step(1)
    expect("replaced", RuntimeError, lambda: model(x, y).backward())
    return errors


def test_misuse_fails_with_one_actionable_line():
    errors = spawn(_misuse, 1)[0]
    assert "parallel.zero=4" in errors["zero"]
    assert "parallel.bucket_mb=0" in errors["bucket"]
    assert "train.precision=bf16" in errors["bf16"]
    assert "num_microbatches=0" in errors["count"]
    assert "start_step(num_microbatches)" in errors["outside"]
    assert "finish_step()" in errors["twice"]
    assert "accumulated 2 gradients in a step declared with 1" in errors["too_many"]
    assert "GradSync.zero_grad()" in errors["replaced"]
    assert all("\n" not in message for message in errors.values())
