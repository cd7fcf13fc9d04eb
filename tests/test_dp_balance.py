"""``parallel.dp_balance=dynamic`` (issue 40), its pure parts: the shares decided from measured
speeds, with hysteresis; the settings' rules; the loader's shares of a global batch. The runs
through ``hybrid-train`` are in ``tests/test_dp_balance_e2e.py``."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hybrid.data import rank_microbatches
from hybrid.data.loader import share_span
from hybrid.data.synthetic import MarkovDataset
from hybrid.planning.balance import (
    Balancer, balance_problem, balance_warnings, best_shares, decide_shares, even_shares,
    predicted_step_s, replica_compute, window_medians,
)
from hybrid.planning.config import Config, ParallelConfig

TRAIN = str(Path(sys.executable).parent / "hybrid-train")


def test_half_speed_replica_gets_a_third_of_the_microbatches():
    assert best_shares([1.0, 2.0], 12) == (8, 4)
    assert best_shares([1.0, 1.0, 1.0, 2.0], 14) == (4, 4, 4, 2)
    # as equal as the speeds, in steps of the schedule's unit, each at least one unit
    assert best_shares([1.0, 1.0], 8, unit=2) == (4, 4)
    assert best_shares([1.0, 100.0], 8, unit=2) == (6, 2)


def test_ties_go_to_the_lower_replica_so_every_rank_decides_alike():
    assert best_shares([1.0, 1.0], 5) == (3, 2)


def test_the_pipeline_bubble_counts_in_the_prediction():
    # u * (m + bubble): without a bubble (6, 2) is best (6, 6); with one, (7, 1) (8, 6)
    assert best_shares([1.0, 3.0], 8) == (6, 2)
    assert predicted_step_s([1.0, 3.0], (6, 2), bubble=1.0) == 9.0
    assert best_shares([1.0, 3.0], 8, bubble=1.0) == (7, 1)


def test_hysteresis_keeps_even_shares_under_noise_and_moves_under_a_half_speed_replica():
    even = even_shares(8, 2)
    assert even == (4, 4)
    noisy = decide_shares([1.0, 1.15], even)  # 15% slower: moving one saves 3.5% < 10%
    assert noisy.shares == even and noisy.saving == 0.0
    slow = decide_shares([1.0, 2.0], even)  # (6, 2): max(6, 4) vs 8 -> saves 25%
    assert slow.shares == (6, 2) and slow.saving == pytest.approx(0.25)
    # the stated share is the threshold
    assert decide_shares([1.0, 2.0], even, min_saving=0.3).shares == even


def test_measurements_are_per_microbatch_medians_of_each_replicas_slowest_rank():
    assert replica_compute([0.1, 0.3, 0.2, 0.25], dp_of_rank=[0, 0, 1, 1], replicas=2) == \
        [0.3, 0.25]
    window = [[0.4, 0.8], [0.4, 9.0], [0.4, 0.8]]  # one disturbed step does not count
    assert window_medians(window) == [0.4, 0.8]


def test_balancer_takes_new_shares_when_two_decisions_in_a_row_ask_for_a_change():
    balancer = Balancer((4, 4), every=2)
    assert not balancer.observe([0.4, 0.8])
    assert not balancer.observe([0.4, 0.8]) and balancer.proposed == (6, 2)
    assert not balancer.observe([0.4, 0.8])
    assert balancer.observe([0.4, 0.8]) and balancer.shares == (6, 2)
    # per micro-batch the same speeds at the new shares: nothing more to move
    for _ in range(6):
        assert not balancer.observe([0.6, 0.4]) and balancer.proposed is None
    assert balancer.restore([5, 3]) and balancer.shares == (5, 3)
    assert not balancer.restore([6, 3]) and balancer.shares == (5, 3)  # another batch
    assert not balancer.history  # the estimate starts afresh


def test_the_speeds_are_estimated_over_the_last_windows_across_changes():
    balancer = Balancer((4, 4), every=2)
    for _ in range(4):
        balancer.observe([0.4, 0.8])
    assert balancer.shares == (6, 2)
    # two steps of a disturbed fast replica (3x slower per micro-batch): the median of the
    # last three windows still holds the two speeds apart, so the shares stay
    assert not balancer.observe([1.8, 0.4]) and not balancer.observe([1.8, 0.4])
    assert balancer.proposed is None and balancer.shares == (6, 2)
    assert len(balancer.history) == 6


def _settle(true_step, shares, steps=60, every=3):
    """Feed a balancer the times of replicas whose step is ``true_step(r, m) = (pipeline,
    fixed)``; the shares it ends at (asserted stable over the last half)."""
    balancer = Balancer(tuple(shares), every=every)
    seen = []
    for _ in range(steps):
        parts = [true_step(r, m) for r, m in enumerate(balancer.shares)]
        balancer.observe([p for p, _ in parts], fixed_s=[f for _, f in parts])
        seen.append(balancer.shares)
    assert len(set(seen[steps // 2:])) == 1, seen
    return balancer.shares


def _optimum(true_step, total, replicas=2):
    """The shares of least true step (by trying every split of two replicas)."""
    splits = [(a, total - a) for a in range(1, total)]
    return min(splits, key=lambda s: max(sum(true_step(r, m)) for r, m in enumerate(s)))


@pytest.mark.parametrize("fixed", [(0.05, 0.05), (0.03, 0.06), (0.0, 0.0), (0.2, 0.4)])
def test_the_fixed_cost_is_priced_apart_so_the_shares_settle_on_the_true_best(fixed):
    # replica 1 at half speed per micro-batch; its fixed cost as the peers' (a collective's
    # own work) or throttled too; counted per micro-batch (the first version), equal fixed
    # costs stopped it at 7/5 (predicted to save under 10% more), not 8/4
    def true_step(r, m):
        return (0.01, 0.02)[r] * m, fixed[r]

    assert _settle(true_step, (6, 6)) == _optimum(true_step, 12)


def test_folding_the_fixed_cost_into_the_rate_under_moves():
    """The model the fix replaced, as a check that the test above can tell the two apart."""
    def folded(r, m):
        return (0.01, 0.02)[r] * m + 0.05, 0.0

    assert _settle(folded, (6, 6)) == (7, 5) != _optimum(folded, 12) == (8, 4)


def test_one_noisy_window_moves_nothing():
    balancer = Balancer((4, 4), every=1)
    assert not balancer.observe([0.4, 1.2])  # proposed
    assert not balancer.observe([0.4, 0.4])  # the last window does not ask again
    assert balancer.proposed is None
    assert not balancer.observe([0.4, 0.4]) and balancer.shares == (4, 4)


def test_an_undisturbed_balancer_keeps_even_shares():
    rng = np.random.default_rng(0)
    balancer = Balancer((8, 8), every=5)
    for _ in range(200):
        balancer.observe(list(0.8 + 0.15 * rng.random(2)))  # up to 19% apart per step
        assert balancer.shares == (8, 8)


def _parallel(**fields) -> ParallelConfig:
    return replace(ParallelConfig(dp=2), **{"dp_balance": "dynamic", **fields})


@pytest.mark.parametrize("fields, needle", [
    ({"dp_balance": "fast"}, "parallel.dp_balance='fast' is unknown; choose one of even, "
                             "dynamic"),
    ({"dp_balance_every": 0}, "parallel.dp_balance_every=0 must be an integer >= 1"),
    ({"dp_balance_every": -3}, "parallel.dp_balance_every=-3 must be an integer >= 1"),
    ({"dp_balance_min_saving": 1.0}, "parallel.dp_balance_min_saving=1.0 must be in (0, 1)"),
    ({"dp_sync_every": 4}, "cannot run with parallel.dp_sync_every=4: its maths assume equal"),
    ({"dp_compress": "powersgd"}, "cannot run with parallel.dp_compress=powersgd"),
    ({"dp_delay": 1}, "cannot run with parallel.dp_delay=1"),
    ({"zero": 2, "pp": 2}, "with parallel.zero=2 needs parallel.pp=1"),
    ({"zero": 3, "pp": 2, "zero3_reshard": "after_step"},
     "with parallel.zero=3 needs parallel.pp=1"),
    ({"zero": 3}, "with parallel.zero=3 needs parallel.zero3_reshard=after_step: with "
                  "after_forward each micro-batch gathers the weights over DP"),
])
def test_settings_it_cannot_run_are_one_line_each(fields, needle):
    problem = balance_problem(_parallel(**fields))
    assert problem and needle in problem and "\n" not in problem


def test_what_it_runs_with():
    for fields in ({}, {"zero": 1}, {"zero": 2}, {"dp_compress": "bf16"},
                   {"dp_balance": "even", "zero": 3}, {"zero": 3, "zero3_reshard": "after_step"},
                   {"zero": 1, "pp": 2}):
        assert balance_problem(_parallel(**fields)) is None, fields


def test_dynamic_with_nothing_to_balance_is_warned():
    cfg = Config(parallel=_parallel(dp=1))
    assert balance_warnings(cfg) == [
        "parallel.dp_balance=dynamic with parallel.dp=1: one replica has nothing to balance "
        "against; set parallel.dp > 1 or drop dp_balance"]
    cfg = replace(cfg, parallel=_parallel(), train=replace(cfg.train, global_batch=4,
                                                           micro_batch=2))
    assert "no replica can give one up" in balance_warnings(cfg)[0]
    assert balance_warnings(replace(cfg, parallel=ParallelConfig(dp=1))) == []


def test_the_warning_comes_before_launch(tmp_path):
    done = subprocess.run([TRAIN, "model=tiny", "parallel=single", "parallel.dp_balance=dynamic",
                           "checkpoint.resume_from=/nowhere", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines()[0].startswith(
        "warning: parallel.dp_balance=dynamic with parallel.dp=1"), done.stderr


@pytest.mark.parametrize("shares", [(4, 4), (7, 1), (2, 6), (1, 5, 1, 1)])
def test_replicas_read_their_own_counts_and_together_the_global_batch(shares):
    data = MarkovDataset(samples=64, seq_len=8, vocab=50, seed=3)
    common = dict(global_batch=16, micro_batch=2, seed=7)
    whole = rank_microbatches(data, 3, dp=1, dp_rank=0, **common)
    dp = len(shares)
    parts = [rank_microbatches(data, 3, dp=dp, dp_rank=r, shares=shares, **common)
             for r in range(dp)]
    assert [len(p) for p in parts] == list(shares)
    joined = [pair for part in parts for pair in part]
    assert all((a[0] == b[0]).all() and (a[1] == b[1]).all() for a, b in zip(joined, whole))


def test_even_shares_are_the_loaders_own_split():
    data = MarkovDataset(samples=64, seq_len=8, vocab=50, seed=3)
    common = dict(global_batch=16, micro_batch=2, seed=7, dp=2, dp_rank=1)
    a = rank_microbatches(data, 0, **common)
    b = rank_microbatches(data, 0, shares=(4, 4), **common)
    assert all((x[0] == y[0]).all() for x, y in zip(a, b))
    assert share_span(8, 2, 1, (7, 1)) == (7, 8)


def test_the_cost_model_prices_a_half_speed_replica_even_and_balanced():
    from hybrid.planning.cost.devices import load_device
    from hybrid.planning.cost.replicas import replica_prediction
    from hybrid.planning.job import plan_job

    cfg = Config(parallel=ParallelConfig(dp=2))
    cfg = replace(cfg, train=replace(cfg.train, global_batch=24, micro_batch=2))
    plan, device = plan_job(cfg), load_device("cpu")
    same = replica_prediction(plan, device, [1.0, 1.0])
    assert same["balanced_shares"] == [6, 6] and same["ratio"] == 1.0
    half = replica_prediction(plan, device, [1.0, 0.5])
    assert half["balanced_shares"] == [8, 4]
    assert half["even_step_s"] > same["even_step_s"] and 0.6 < half["ratio"] < 0.9


def test_hybrid_plan_prints_the_prediction_and_refuses_a_wrong_count(tmp_path):
    plan = str(Path(sys.executable).parent / "hybrid-plan")
    common = [plan, "model=tiny", "parallel=single", "parallel.dp=2", "train.global_batch=24"]
    done = subprocess.run([*common, "cost.replica_speed=[1,0.5]"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "replicas at speeds [1.0, 0.5] (cost.replica_speed): even shares step" in done.stdout
    bad = subprocess.run([*common, "cost.replica_speed=[1,0.5,1]"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: cost.replica_speed=[1.0, 0.5, 1.0] names 3 replicas but parallel.dp=2; give "
        "one speed per DP replica (1 = the device's)")


@pytest.mark.parametrize("own, extra, expected", [
    (4, 4, "RZ" * 4), (3, 6, "RZZ" * 3), (3, 1, "RRRZ"), (4, 0, "RRRR")])
def test_zero2_spreads_its_rounds_of_zeros_among_its_own(own, extra, expected):
    """A replica with fewer micro-batches under ZeRO-2 matches the others' per-micro-batch
    reduce-scatters with zeros; spread in proportion, its rounds keep pace with theirs (at
    the end, the faster replica would wait for each of its micro-batches, then run alone)."""
    from types import SimpleNamespace

    import torch

    from hybrid.dp.zero2 import StagedShards

    issued = []

    class Group:
        def size(self):
            return 2

        def reduce_scatter_into(self, out, staging, async_op):
            issued.append("R" if staging.any() else "Z")
            return None

    def shard(index):
        bucket = SimpleNamespace(index=index, numel=4, late=False, params=[0],
                                 shard_group=Group(),
                                 span=lambda slot: (0, 4))
        return SimpleNamespace(bucket=bucket, grad=torch.zeros(2))

    staged = StagedShards([shard(0), shard(1)], wait=lambda work: None)
    staged.extra_rounds, staged.own_rounds = extra, own
    param = torch.zeros(4)
    for _ in range(own):
        for s in staged.shards:
            param.grad = torch.ones(4)
            staged.accumulated(s.bucket, 0, param)
    staged.flush()
    assert "".join(issued[::2]) == expected and issued[::2] == issued[1::2]


def _dp2_plan(**parallel):
    from hybrid.planning.job import plan_job

    cfg = Config(parallel=replace(ParallelConfig(dp=2), **parallel))
    return plan_job(replace(cfg, train=replace(cfg.train, global_batch=24, micro_batch=2)))


def test_the_straggler_warning_says_what_balancing_would_save():
    from hybrid.balance.replicas import ReplicaShares

    shares = ReplicaShares(_dp2_plan(), dp_rank=0, dp_of_rank=[0, 1])
    clause = shares.straggler_clause(rank=1, ratio=2.0)
    assert clause.startswith("; parallel.dp_balance=dynamic would save ")
    assert "(cost model at replica speeds [1.0, 0.5]: even " in clause
    assert "balanced [8, 4]" in clause and "\n" not in clause
    saved = float(clause.split("would save ")[1].split("%")[0])
    assert 10 < saved < 40
    # already balancing, or nothing to balance against: nothing added
    dynamic = ReplicaShares(_dp2_plan(dp_balance="dynamic"), dp_rank=0, dp_of_rank=[0, 1])
    assert dynamic.straggler_clause(rank=1, ratio=2.0) == ""


def test_the_sweep_report_says_what_balancing_would_save(tmp_path):
    import json

    from hybrid.planning.config import to_dict
    from launch.reports.sweep_report import _balance_note, _balance_saving

    plan = _dp2_plan()
    (tmp_path / "config.json").write_text(json.dumps(to_dict(plan.cfg)))
    steps = [{"step": s, "compute_s": [0.1, 0.2 if s > 1 else 0.9]} for s in range(1, 8)]
    (tmp_path / "rank_times.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    row = {"cell": "3", **_balance_saving(tmp_path)}
    assert row["replica_speed"] == [1.0, 0.5] and 0.1 < row["dp_balance_saving"] < 0.4
    note = _balance_note([row, {"cell": "4", "dp_balance_saving": ""}])
    assert note.startswith("Balancing: parallel.dp_balance=dynamic would save, by the cost "
                           "model at each cell's measured replica speeds: cell 3 ")
    assert note.endswith("(replica speeds [1.0, 0.5]).")
    assert _balance_note([{"dp_balance_saving": ""}]).startswith("Balancing: no completed")
