"""The cost model on a CPU host whose ranks share its cores (hybrid/planning/cost/steptime.py
with a calibrated device's figures): what each measured figure changes, and only that."""

from dataclasses import replace

import pytest

from hybrid.planning.config import Config, ModelConfig, TrainConfig
from hybrid.planning.cost.devices import PRESETS, Device, Link
from hybrid.planning.cost.steptime import predict_step, step_lower_bound
from hybrid.planning.job import plan_job

SMALL = ModelConfig(layers=8, hidden=256, heads=8, seq_len=128, vocab=512)
# A 2-core host as calibrate writes it: one core's rate, gloo's links, a TP call's cost.
HOST = Device(name="calibrated:test", flops={"fp32": 90e9, "bf16": 90e9},
              memory_bytes=3 * 2**30, intra=Link(bandwidth=1e9, latency=150e-6),
              inter=Link(bandwidth=1e9, latency=1e-4), matmul_half_width=64.0,
              matmul_half_rows=32.0, optimizer_s_per_param=1.5e-9, cores=2,
              thread_speedup=1.9, thread_half_rows=50.0, collective_overhead_s=2e-3,
              collective_cpu_s=1e-3, host=True)


def config(**parallel) -> Config:
    cfg = Config(model=replace(SMALL), train=TrainConfig(global_batch=16, micro_batch=2))
    cfg.parallel = replace(cfg.parallel, **parallel)
    return cfg


def predict(device: Device = HOST, **parallel):
    return predict_step(plan_job(config(**parallel)), device)


def test_ranks_beyond_the_cores_pay_the_share_of_throughput_they_keep():
    crowded = replace(HOST, core_efficiency={"4": 0.8, "8": 0.7})
    assert crowded.sharing_efficiency(2) == 1.0  # one rank per core: the calibrated rate
    assert crowded.sharing_efficiency(4) == 0.8 and crowded.sharing_efficiency(6) == 0.8
    assert replace(HOST).sharing_efficiency(8) == 1.0  # not measured: none lost
    # dp4 on 2 cores: every rank's work over the cores, at 80% of their throughput
    alone, shared = predict(dp=4), predict(crowded, dp=4)
    assert shared.step_time_s - shared.dp_exposed_s == pytest.approx(
        (alone.step_time_s - alone.dp_exposed_s) / 0.8, rel=1e-9)
    assert predict(crowded, dp=2).step_time_s == predict(dp=2).step_time_s


def test_a_tp_group_larger_than_the_cores_pays_its_own_measured_call():
    measured = replace(HOST, tp_calls={"2": [1e-3, 5e-4, 6e-4, 3e-4], "4": [8e-3, 1e-3]})
    assert measured.tp_call(2) == (1e-3, 5e-4) and measured.tp_call(8) == (8e-3, 1e-3)
    assert measured.tp_call(2, sequence_parallel=True) == (6e-4, 3e-4)  # its own calls
    assert HOST.tp_call(4) == (2e-3, 1e-3)  # none measured by size: the 2-way figure
    small, large = replace(measured, tp_calls={"2": [1e-3, 5e-4]}), measured
    assert predict(large, tp=2).step_time_s == predict(small, tp=2).step_time_s
    assert predict(large, tp=4).step_time_s > predict(small, tp=4).step_time_s


def test_a_tp_shards_compute_costs_its_measured_share_of_its_price():
    """``tp_compute`` scales a TP rank's layer compute (forward, backward and full
    recompute's forward again) and nothing else: not its collectives, not its head, not
    layouts without TP."""
    from hybrid.planning.cost.flops import layer_forward_flops

    shard = replace(HOST, tp_compute={"2": 0.5, "4": 0.8})
    assert shard.tp_compute_factor(1) == 1.0 and HOST.tp_compute_factor(2) == 1.0
    assert shard.tp_compute_factor(8) == 0.8  # the nearest measured size
    rate = HOST.compute_rate("fp32", SMALL.hidden / 2, 2 * SMALL.seq_len)
    layers = 8 * 3 * SMALL.layers * layer_forward_flops(SMALL, 2) / 2 / rate  # a step's
    for recompute, passes in (("none", 3), ("full", 4)):
        cfg = config(tp=2)
        cfg.model = replace(SMALL, recompute=recompute)
        priced, measured = (predict_step(plan_job(cfg), d) for d in (HOST, shard))
        assert measured.tp_s == priced.tp_s
        assert measured.compute_s == pytest.approx(
            priced.compute_s - passes / 3 * layers / 2, rel=1e-9)
    assert predict(shard, dp=2).step_time_s == predict(dp=2).step_time_s


def test_tp_calls_per_step_are_the_ones_hybrids_model_makes():
    """Per micro-batch, forward: two all-reduces a layer, the embedding's and the cross
    entropy's one gather; backward: two a layer and the head's input gradient (a tp2 run of
    this model counts 8 x (4 x 8 + 3) = 280 TP calls a step in metrics.jsonl). With sequence
    parallelism each all-reduce is two calls, the head gathers the sequence and the
    embedding's gradient is gathered back: 8 x (8 x 8 + 5), and one all-reduce of the norms'
    gradients a step, not priced (553 counted)."""
    instant = Link(bandwidth=1e30, latency=0.0)
    calls_only = replace(HOST, intra=instant, inter=instant, group_links={},
                         tp_calls={"2": [2e-3, 1e-3, 1e-3, 5e-4]})
    microbatches = 16 // 2
    assert predict(calls_only, tp=2).tp_s == pytest.approx(
        microbatches * (4 * SMALL.layers + 3) * 2e-3)
    assert predict(calls_only, tp=2, sequence_parallel=True).tp_s == pytest.approx(
        microbatches * (8 * SMALL.layers + 5) * 1e-3)


def test_gloo_reduces_on_the_cores_that_compute_so_nothing_of_it_hides():
    dp2 = predict(dp=2)
    assert dp2.dp_s > 0 and dp2.dp_exposed_s == dp2.dp_s
    # on a GPU the same reduction hides behind the backward but for its last bucket (ready
    # only when the backward ends), and its time is still reported
    wide = Config(model=replace(SMALL, hidden=2048, heads=16, seq_len=2048),
                  train=TrainConfig(global_batch=32, micro_batch=1, precision="bf16"))
    wide.parallel = replace(wide.parallel, dp=2)
    gpu = predict_step(plan_job(wide), PRESETS["h100-80gb"])
    assert gpu.dp_s > 0 and 0 < gpu.dp_exposed_s < 0.05 * gpu.dp_s


def test_a_split_backward_costs_its_measured_factor_on_the_stages_that_split():
    split = replace(HOST, split_backward_factor=1.25)
    assert predict(split, pp=2, schedule="1f1b").step_time_s == predict(
        pp=2, schedule="1f1b").step_time_s
    zb, zb_split = predict(pp=2, schedule="zb-h1"), predict(split, pp=2, schedule="zb-h1")
    # stage 0 has no input gradient to hurry: only the last stage's backward grows
    assert zb.compute_s < zb_split.compute_s < zb.compute_s * 1.25


def test_pipeline_messages_cost_the_shared_cores_cpu():
    free = replace(HOST, collective_cpu_s=0.0)
    chunks = dict(pp=4, vpp=2, schedule="interleaved-1f1b")
    # 4 ranks on 2 cores: 2 x 8 micro-batches x 7 boundaries of gloo CPU, over the cores
    assert predict(**chunks).step_time_s - predict(free, **chunks).step_time_s == pytest.approx(
        2 * 8 * 7 * 1e-3 / 2, rel=1e-6)


@pytest.mark.parametrize("parallel", [
    dict(dp=4), dict(tp=4), dict(pp=2, schedule="zb-h1"), dict(dp=2, tp=2, pp=2),
    dict(pp=4, vpp=2, schedule="interleaved-1f1b"), dict(dp=2, pp=2, zero=1)])
def test_the_searchs_bound_stays_under_the_simulation_on_shared_cores(parallel):
    device = replace(HOST, core_efficiency={"4": 0.9, "8": 0.85}, split_backward_factor=1.1,
                     tp_calls={"2": [2e-3, 1e-3], "4": [6e-3, 2e-3]})
    plan = plan_job(config(**parallel))
    assert step_lower_bound(plan, device) <= predict_step(plan, device).step_time_s * (1 + 1e-9)
