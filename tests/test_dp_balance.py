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


def test_balancer_takes_new_shares_when_two_windows_in_a_row_ask_for_a_change():
    balancer = Balancer((4, 4), every=2)
    assert not balancer.observe([0.4, 0.8])
    assert not balancer.observe([0.4, 0.8]) and balancer.proposed == (6, 2)
    assert not balancer.observe([0.4, 2.0])
    assert balancer.observe([0.4, 2.0]) and balancer.shares == (7, 1)  # the second window's
    assert not balancer.observe([0.6, 0.4], decide=True)  # (6, 2) is best at these speeds
    assert balancer.restore([6, 2]) and balancer.shares == (6, 2)
    assert not balancer.restore([6, 3]) and balancer.shares == (6, 2)  # another batch


def test_one_noisy_window_moves_nothing():
    balancer = Balancer((4, 4), every=1)
    assert not balancer.observe([0.4, 0.8])  # proposed
    assert not balancer.observe([0.4, 0.4])  # not asked again: forgotten
    assert not balancer.observe([0.4, 0.8]) and balancer.shares == (4, 4)


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
    ({"zero": 2, "vpp": 2}, "with parallel.zero=2 needs one model chunk per pipeline rank"),
    ({"zero": 3}, "cannot run with parallel.zero=3"),
])
def test_settings_it_cannot_run_are_one_line_each(fields, needle):
    problem = balance_problem(_parallel(**fields))
    assert problem and needle in problem and "\n" not in problem


def test_what_it_runs_with():
    for fields in ({}, {"zero": 1}, {"zero": 2}, {"dp_compress": "bf16"},
                   {"dp_balance": "even", "zero": 3}):
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
