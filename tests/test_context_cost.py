"""Context parallelism in the cost model (pure): memory per rank, the ring's time and what of it
hides, the step's prediction, and the layout search choosing cp and saying why. The ring's
bytes are checked against the counted ones in every end-to-end run (``checked_records``)."""

from dataclasses import replace

import pytest

from hybrid.planning.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hybrid.planning.cost.context_time import cp_step_bytes, kv_block_bytes, ring_times
from hybrid.planning.cost.devices import PRESETS, Link
from hybrid.planning.cost.search import format_search, search, searched_cps
from hybrid.planning.cost.steptime import predict_step
from hybrid.planning.job import plan_job
from hybrid.planning.layout import Layout

GPU = PRESETS["h100-80gb"]


def config(cp=1, comm="p2p", recompute="none", seq=32768, **parallel) -> Config:
    model = ModelConfig(name="13b", layers=8, hidden=5120, heads=40, vocab=50257,
                        seq_len=seq, recompute=recompute)
    return Config(model=model, train=TrainConfig(global_batch=8, micro_batch=1),
                  parallel=ParallelConfig(**{"tp": 8, **parallel, "cp": cp, "cp_comm": comm}),
                  cost=replace(Config().cost, device="h100-80gb"))


def test_activations_per_rank_fall_as_1_over_cp():
    one = plan_job(config()).memory[0].activation_bytes
    for cp in (2, 4, 8):
        assert plan_job(config(cp)).memory[0].activation_bytes == pytest.approx(one / cp,
                                                                                rel=1e-6)


@pytest.mark.parametrize("comm,recompute,blocks", [
    ("p2p", "none", 1 + 3), ("allgather", "none", 1 + 2), ("p2p", "full", 1 + 3 + 1)])
def test_the_ring_sends_what_each_pass_needs(comm, recompute, blocks):
    cfg = config(2, comm, recompute)
    layout = Layout(cp=2, tp=8)
    block = 2 * 1 * (32768 // 2) * (5120 // 8) * 4  # k and v, fp32, this rank's tokens
    assert kv_block_bytes(cfg, layout) == block
    assert cp_step_bytes(cfg, layout, layers=8, microbatches=3) == blocks * block * 8 * 3


def test_p2p_hides_a_pass_behind_a_long_enough_block_and_allgather_hides_nothing():
    cfg, layout, link = config(4), Layout(cp=4, tp=8), Link(bandwidth=100e9, latency=1e-5)
    one_pass = kv_block_bytes(cfg, layout) / link.bandwidth + link.latency
    long = ring_times(cfg, layout, link, attention_s=100 * one_pass)
    assert long.forward_exposed_s == 0 and long.backward_exposed_s == pytest.approx(one_pass)
    short = ring_times(cfg, layout, link, attention_s=0.0)
    assert short.forward_exposed_s == pytest.approx(short.forward_s) == pytest.approx(3 * one_pass)
    on_cpu = ring_times(cfg, layout, link, attention_s=100 * one_pass, overlaps=False)
    assert on_cpu.backward_exposed_s == pytest.approx(on_cpu.backward_s)
    gathered = ring_times(config(4, "allgather"), layout, link, attention_s=100 * one_pass)
    assert gathered.forward_exposed_s == gathered.forward_s > 0


def test_the_prediction_splits_compute_over_cp_and_prices_the_ring():
    one, two = (predict_step(plan_job(config(cp)), GPU) for cp in (1, 2))
    assert two.cp_s > 0 and 0 <= two.cp_exposed_s < two.cp_s  # most of the ring hides
    assert one.cp_s == 0
    assert two.compute_s < 0.6 * one.compute_s  # half the tokens, plus the exposed ring


def test_the_search_tries_cp_only_where_each_rank_keeps_enough_tokens():
    assert searched_cps(2048, 1024) == [1]
    assert searched_cps(32768, 64) == [1, 2, 4, 8, 16]
    assert searched_cps(32768, 24) == [1, 2, 4, 8]


@pytest.mark.slow
def test_the_search_proposes_cp_where_only_cp_fits_and_says_why():
    """GPT-3 13B at a 512K-token sequence on 64 H100s: no layout without context parallelism
    fits (even TP 8 with full recompute), one with it does."""
    cfg = replace(config(seq=524288), model=replace(config().model, layers=40,
                                                    seq_len=524288))
    result = search(cfg, 64, GPU, top=3)
    best = result["candidates"][0]
    assert best["settings"]["cp"] > 1
    assert result["why_cp"].startswith(f"cp={best['settings']['cp']}: no layout with cp=1 "
                                       f"fits in device memory")
    assert "why cp=" in format_search(result) and " cp " in format_search(result)
