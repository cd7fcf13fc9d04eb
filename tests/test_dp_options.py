"""The lossy DP options on a 2-rank GPT: what each sends (counted = predicted, step by step)
and the property that makes each one right: bf16 is the mean to bf16's precision, PowerSGD's
error feedback loses nothing, local SGD replicas agree exactly at a sync, a delayed step applies
the previous step's exact mean. Exactness of zero=2 is in test_dp and the end-to-end tests."""

import pytest
import torch
import torch.distributed as dist

from hybrid.comm import CommCounter
from hybrid.planning.config import ModelConfig, OptimConfig
from hybrid.dp import GradSync
from hybrid.planning.cost.dp_traffic import gradient_bytes, step_bytes
from hybrid.planning.strategies import SCALAR, DpOptions, all_reduce_bytes, option_problem
from hybrid.groups import ParallelGroups
from hybrid.planning.layout import Layout
from hybrid.planning.cost.state_bytes import rank_shapes
from hybrid.testing import spawn

pytestmark = pytest.mark.timeout(180)

MODEL = ModelConfig(layers=2, hidden=32, heads=4, vocab=120, vocab_pad_multiple=64,
                    seq_len=16)
OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1)
BUCKET_MB = 0.02
STEPS, MICROBATCHES = 4, 2
OPTIONS = {
    "bf16": DpOptions(compress="bf16"),
    "bf16-zero1": DpOptions(compress="bf16", zero=1),
    "powersgd": DpOptions(compress="powersgd", powersgd_rank=1, powersgd_warmup=1),
    "sync2": DpOptions(sync_every=2, sync_moments=True),
    "delay": DpOptions(delay=1),
    "zero2": DpOptions(zero=2),
}


def _flat_grads(sync) -> torch.Tensor:
    return torch.cat([b.grad.clone() for b in sync.buckets])


def _mean(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.clone()
    dist.all_reduce(out)
    return out / dist.get_world_size()


def _backward(model, step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + rank)
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, MODEL.vocab, (2, MODEL.seq_len + 1), generator=gen)
        (model(tokens[:, :-1], tokens[:, 1:]) / MICROBATCHES).backward()


def _run_option(name: str, rank: int) -> dict:
    from hybrid.model import GPT

    groups = ParallelGroups.create(Layout(dp=2))
    model = GPT(MODEL, groups, seed=3)
    options = OPTIONS[name]
    sync = GradSync(model, groups, OPTIM, bucket_mb=BUCKET_MB, zero=options.zero,
                    options=options)
    counter, out = CommCounter(groups), {"bytes": [], "checks": []}
    local_grads, previous_mean = _capture_local_grads(sync), None
    for step in range(1, STEPS + 1):
        sync.start_step(MICROBATCHES, step=step)
        before = _error_state(sync)
        with counter.track():
            _backward(model, step, rank)
            sync.reduce_gradients()
        local = None if options.zero == 2 else local_grads(sync)
        out["checks"].append(_check(name, sync, local, before, step))
        with counter.track():
            applied = _finish(sync, options, step)
        if name == "delay":  # step t applied step t-1's exact mean (step 1: nothing)
            out["checks"].append(applied is None if step == 1 else
                                 torch.allclose(applied, previous_mean, rtol=1e-6, atol=0))
            previous_mean = _mean(local)
        out["bytes"].append(counter.snapshot()["dp"]["bytes"])
        counter.reset()
        out["checks"].append(_check_after(name, model, step))
    return out


def _capture_local_grads(sync):
    """The reducer starts on the buckets during the backward, in place: keep a copy of each
    bucket's local gradients as it is handed over; ``local_grads(sync)`` then gives them."""
    captured, launch = {}, sync.reducer.launch

    def capturing(bucket, shard):
        captured[bucket.index] = bucket.grad.clone()
        launch(bucket, shard)

    sync.reducer.launch = capturing

    def local_grads(sync) -> torch.Tensor:
        if not captured:  # nothing launched: local SGD, delayed (reduced in finish)
            return _flat_grads(sync)
        return torch.cat([captured.pop(b.index) for b in sync.buckets])

    return local_grads


def _finish(sync, options: DpOptions, step: int) -> None:
    """The rest of ``finish_step`` after ``reduce_gradients`` (which the test ran apart);
    with a delay, returns the gradients it applied (None: none)."""
    apply = sync.reducer.before_update()
    applied = _flat_grads(sync) if apply else None
    if apply:
        sync.clip_grad_norm_(1.0)
        sync.optimizer_step(1e-2)
    sync.reducer.after_update(step, sync.optimizer)  # local SGD averages every H steps
    sync.zero_grad()
    return applied


def _error_state(sync):
    reducer = sync.reducer
    if not hasattr(reducer, "matrices"):
        return None
    return [x.error.clone() for ms in reducer.matrices.values() for x in ms]


def _check(name: str, sync, local, errors_before, step: int) -> bool:
    """The property of the reduced gradients that makes the option right."""
    if local is None or name in ("sync2", "delay"):
        return True
    exact, reduced = _mean(local), _flat_grads(sync)
    if name.startswith("bf16"):
        # each rank's share rounded to bf16 (8 bits), then their sum: relative to the
        # magnitudes summed, not to the mean (which may cancel)
        scale = _mean(local.abs())
        if sync.sharding.shards_state:  # the shard holds this rank's part of the mean
            shard = sync.shards[0]
            exact, reduced = exact[shard.start:shard.end], shard.grad
            scale = scale[shard.start:shard.end]
        return bool(((reduced - exact).abs() <= 2 ** -7 * scale + 1e-12).all())
    if step == 1:  # PowerSGD's exact warm-up step
        return torch.allclose(reduced, exact, rtol=1e-5, atol=1e-7)
    # error feedback: approximation + the new errors' mean = the mean + the old errors' mean
    grads = dict(_matrix_grads(sync))
    errors_after = _error_state(sync)
    for (key, approx), old, new in zip(grads.items(), errors_before, errors_after):
        mean_grad = _mean(local[key[0]:key[1]].view_as(old))
        if not torch.allclose(approx + _mean(new), mean_grad + _mean(old), atol=1e-6):
            return False
    return True


def _matrix_grads(sync):
    """(flat span of the compressed matrix in ``_flat_grads``, its reduced gradient)."""
    offset = 0
    for bucket in sync.buckets:
        for x in sync.reducer.matrices[bucket.index]:
            begin, end = bucket.span(x.slot)
            yield (offset + begin, offset + end), bucket.grad_view(x.slot).view(x.rows, x.cols)
        offset += bucket.numel


def _check_after(name: str, model, step: int) -> bool:
    """Local SGD: replicas differ between syncs and agree exactly after one."""
    if name != "sync2":
        return True
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    same = torch.equal(both[0], both[1])
    return same if step % 2 == 0 else not same


def _all_options(rank: int, world: int) -> dict:
    return {name: _run_option(name, rank) for name in OPTIONS}


def test_each_option_sends_what_the_model_predicts_and_keeps_its_promise():
    shapes = rank_shapes(MODEL, list(range(MODEL.layers + 2)), tp=1, sp=False, pp=1)
    for name, result in spawn(_all_options, 2, timeout=150)[0].items():
        options = OPTIONS[name]
        predicted = [gradient_bytes(shapes, dp=2, options=options, step=step,
                                    microbatches=MICROBATCHES, bucket_mb=BUCKET_MB)
                     + (all_reduce_bytes(SCALAR, 2) if options.zero else 0)  # the norm
                     for step in range(1, STEPS + 1)]
        assert result["bytes"] == pytest.approx(predicted, rel=1e-9), name
        assert all(result["checks"]), (name, result["checks"])
    exact = [step_bytes(shapes, dp=2, options=DpOptions(), step=s, microbatches=MICROBATCHES,
                        bucket_mb=BUCKET_MB) for s in (1, 2)]
    compressed = [step_bytes(shapes, dp=2, options=OPTIONS["powersgd"], step=s,
                             microbatches=MICROBATCHES, bucket_mb=BUCKET_MB) for s in (1, 2)]
    assert compressed[0] == exact[0] and compressed[1] < exact[1] / 4


@pytest.mark.parametrize("options,dp,fragment", [
    (DpOptions(compress="zip"), 2, "parallel.dp_compress='zip' is unknown"),
    (DpOptions(compress="bf16"), 1, "parallel.dp=1 has one replica"),
    (DpOptions(compress="bf16", delay=1), 2, "do not combine"),
    (DpOptions(zero=2, compress="bf16"), 2, "parallel.zero=2 runs with exact reduction"),
    (DpOptions(zero=1, compress="powersgd"), 2, "needs unsharded optimizer state"),
    (DpOptions(sync_every=0), 2, "parallel.dp_sync_every=0 must be an integer >= 1"),
    (DpOptions(delay=2), 2, "parallel.dp_delay=2 is unknown"),
    (DpOptions(sync_moments=True), 2, "dp_sync_moments=true does nothing"),
])
def test_option_problems_are_one_line_with_the_fix(options, dp, fragment):
    problem = option_problem(options, dp)
    assert fragment in problem and "\n" not in problem


def test_exact_options_have_no_problem():
    for zero in (0, 1, 2):
        assert option_problem(DpOptions(zero=zero), 4) is None
