"""ZeRO-1: shard layout (no processes) and optimizer-state bytes per DP rank (gloo).

Training parity with and without ZeRO-1 is in ``tests/test_dp.py``.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hybrid.planning.config import OptimConfig
from hybrid.dp import Bucket, GradSync, Shard
from hybrid.dp.state import OptimizerStateError
from hybrid.groups import ParallelGroups
from hybrid.planning.layout import Layout
from hybrid.optim import optimizer_state_bytes
from hybrid.testing import spawn

pytestmark = pytest.mark.timeout(180)

OPTIM = OptimConfig(lr=1e-2, warmup_steps=0)


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_shards_cover_every_parameter_element_exactly_once(dp_size):
    params = [nn.Parameter(torch.randn(n)) for n in (5, 3, 7)]  # 15 elements
    placement = SimpleNamespace(size=lambda: dp_size)  # no collective runs here
    bucket = Bucket.allocate(0, params, pad_to=dp_size, group=placement, shard_group=placement)
    bucket.flatten_params()
    assert bucket.numel % dp_size == 0 and bucket.numel - 15 < dp_size
    covered = torch.zeros(bucket.numel, dtype=torch.int64)
    for rank in range(dp_size):
        shard = Shard.of(bucket, rank, dp_size)
        for piece in shard.pieces(lambda p: True, lambda p: True):
            start = (piece.tensor.data_ptr() - bucket.data.data_ptr()) // 4
            covered[start:start + piece.tensor.numel()] += 1
            assert piece.grad.numel() == piece.tensor.numel()
    assert covered[:15].tolist() == [1] * 15 and covered[15:].sum() == 0  # padding: no state
    for param, (start, end) in zip(params, (bucket.span(i) for i in range(3))):
        assert param.data_ptr() == bucket.data[start:end].data_ptr()  # params are views


class Even(nn.Module):
    """Buckets of 528, 608 and 64 elements with 1 KiB buckets: each divides by 2 and 4."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.position = nn.Parameter(torch.randn(4, 16))
        self.inp, self.norm, self.out = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16)

    def forward(self, x):
        return self.out(self.norm(torch.tanh(self.inp(x + self.position)))).square().mean()


class Odd(nn.Module):
    """One bucket of 18 elements: padded to 20 for 4 ranks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(5, 3)

    def forward(self, x):
        return self.lin(x[..., :5]).square().mean()


def _state_bytes(rank, world):
    groups = ParallelGroups.create(Layout(dp=world))
    out = {}
    for model_cls in (Even, Odd):
        for zero in (0, 1):
            model = model_cls()
            sync = GradSync(model, groups, OPTIM, bucket_mb=0.001, zero=zero)
            sync.start_step(1)
            model(torch.randn(2, 4, 16) * (rank + 1)).backward()
            sync.finish_step(lr=1e-2, max_norm=1.0)  # creates AdamW's state
            checksum = sum(p.double().sum().item() for p in model.parameters())
            out[(model_cls.__name__, zero)] = (optimizer_state_bytes(sync.optimizer), checksum)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_zero1_optimizer_state_per_rank_is_one_dth_of_unsharded(world):
    results = spawn(_state_bytes, world)
    unsharded = results[0][("Even", 0)][0]["per_element"]
    assert unsharded == 2 * 4 * 1200  # exp_avg + exp_avg_sq, fp32, 1200 parameters
    for out in results:
        assert out[("Even", 0)][0]["per_element"] == unsharded  # no ZeRO: full state everywhere
        assert out[("Even", 1)][0]["per_element"] * world == unsharded  # exactly 1/d
    # With padding the shards still add up exactly; no rank holds more than ceil(n/d).
    odd = [out[("Odd", 1)][0]["per_element"] for out in results]
    assert sum(odd) == results[0][("Odd", 0)][0]["per_element"] == 2 * 4 * 18
    assert max(odd) <= 2 * 4 * -(-18 // world)
    # After the all-gather every DP rank holds the same parameters as without ZeRO.
    for name in ("Even", "Odd"):
        plain = results[0][(name, 0)][1]
        assert all(out[(name, 1)][1] == pytest.approx(plain, rel=1e-6) for out in results)


def _state_by_name(rank, world):
    """Two steps under each (zero, bucket) setting must give the same state by name; the
    zero=0 state loaded into a fresh ZeRO-1 optimizer with other buckets reads back bitwise.
    Compared here (tensors do not travel back through the result queue)."""
    groups = ParallelGroups.create(Layout(dp=world))
    states = {}
    for zero, bucket_mb in [(0, 25.0), (1, 0.001), (1, 0.0005)]:
        model = Even()
        sync = GradSync(model, groups, OPTIM, bucket_mb=bucket_mb, zero=zero)
        for step in range(2):
            sync.start_step(1)
            model(torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(step + rank))
                  ).backward()
            sync.finish_step(lr=1e-2, max_norm=1.0)
        states[(zero, bucket_mb)] = {n: {k: t.clone() for k, t in s.items()}
                                     for n, s in sync.state_dict().items()}
    plain = states[(0, 25.0)]
    report = {"names": sorted(plain), "steps": sorted({float(s["step"]) for s in plain.values()}),
              "differ": [], "reload_differs": []}
    for setting, state in states.items():
        for name in plain:
            for key in ("exp_avg", "exp_avg_sq"):
                if sorted(state) != sorted(plain) or not torch.allclose(
                        state[name][key], plain[name][key], rtol=1e-5, atol=1e-9):
                    report["differ"].append((setting, name, key))
    fresh = GradSync(Even(), groups, OPTIM, bucket_mb=0.0007, zero=1)
    fresh.load_state_dict(plain)
    reloaded = fresh.state_dict()
    report["reload_differs"] = [(name, key) for name in plain for key in ("exp_avg", "exp_avg_sq",
                                                                          "step")
                                if not torch.equal(reloaded[name][key], plain[name][key])]
    try:  # a state without one parameter must not load (nothing left at its initial value)
        fresh.load_state_dict({n: s for n, s in plain.items() if n != "norm.bias"})
    except OptimizerStateError as err:
        report["missing"] = str(err)
    return report


def test_optimizer_state_is_addressed_by_name_whatever_zero_and_buckets():
    for report in spawn(_state_by_name, 2):
        assert report["names"] == ["inp.bias", "inp.weight", "norm.bias", "norm.weight",
                                   "out.bias", "out.weight", "position"]
        assert report["steps"] == [2.0]
        assert report["differ"] == [] and report["reload_differs"] == []
        assert report["missing"] == "no complete optimizer state for norm.bias"
