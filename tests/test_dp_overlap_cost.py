"""#42, fourth pass: what a data-parallel reduction costs beyond its own time on a GPU. A
reduction the backward hides still holds SMs while it runs, so the multiplies beside it run
slower (``Device.collective_sm_share``); Megatron-LM's ``local`` DDP reduces its whole buffer
in one collective after the backward, where PyTorch's DDP reduces 25 MB buckets during it
(``published.megatron_lm``)."""

from dataclasses import replace

import pytest

from hybrid.planning.config import Config, ModelConfig, TrainConfig
from hybrid.planning.cost.collectives import ring_all_reduce
from hybrid.planning.cost.devices import COLLECTIVE_SMS, PRESETS
from hybrid.planning.cost.published import (
    FP16_UNSCALE_BYTES, LOCAL_DDP_BYTES, MIXED_PRECISION_STEP_BYTES, TORCH_DDP_BYTES,
    megatron_lm,
)
from hybrid.planning.cost.stage_time import link_for, stage_times
from hybrid.planning.cost.steptime import predict_step
from hybrid.planning.job import plan_job

A100 = PRESETS["a100-80gb"]
WIDE = ModelConfig(layers=16, hidden=2048, heads=16, seq_len=2048, vocab=4096)


def plan(dp: int = 8, recompute: str = "none", **parallel):
    cfg = Config(model=replace(WIDE, recompute=recompute),
                 train=TrainConfig(global_batch=dp, micro_batch=1, precision="bf16"))
    cfg.parallel = replace(cfg.parallel, dp=dp, **parallel)
    cfg.cost.gpus_per_node = 8
    return plan_job(cfg)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_multiplies_beside_a_hidden_reduction_lose_the_sms_it_holds(recompute):
    job = plan(recompute=recompute)
    p = predict_step(job, A100)
    free = predict_step(job, replace(A100, collective_sm_share=0.0))
    hidden = p.dp_s - p.dp_exposed_s
    assert hidden > 0.9 * p.dp_s > 0  # the backward hides all but the last bucket
    stage = stage_times(job, A100, job.stages[0].blocks)
    share = stage.backward_matmul / stage.backward
    assert 0.5 < share < 1  # the rest: norms, adds, activations bound by memory
    assert p.dp_contention_s == pytest.approx(hidden * COLLECTIVE_SMS / 108 * share)
    assert p.step_time_s == pytest.approx(free.step_time_s + p.dp_contention_s)
    assert free.dp_contention_s == 0


def test_the_backwards_multiplies_are_twice_the_forwards_and_a_recomputed_forward():
    """With no memory-bound work priced, the backward of a stage without the head (which is
    not recomputed) is all multiplies: what the share above divides by counts every multiply
    once, the recomputed forward's too."""
    bare = replace(A100, memory_bandwidth=0.0, kernel_s=0.0)
    for recompute, passes in (("none", 2), ("full", 3)):
        job = plan(recompute=recompute, pp=2)
        stage = stage_times(job, bare, job.stages[0].blocks)
        assert stage.backward_matmul == pytest.approx(stage.backward, rel=1e-12)
        assert stage.backward_matmul == pytest.approx(passes * stage.forward, rel=1e-12)


def test_nothing_is_lost_where_nothing_of_the_reduction_hides():
    job = plan()
    after = predict_step(job, replace(A100, dp_after_backward=True))
    assert after.dp_exposed_s == after.dp_s > 0 and after.dp_contention_s == 0
    assert predict_step(job, PRESETS["cpu"]).dp_contention_s == 0  # gloo: priced exposed
    assert predict_step(plan(dp=1), A100).dp_contention_s == 0
    assert PRESETS["h100-80gb"].collective_sm_share == pytest.approx(16 / 132)


def test_megatron_lms_local_ddp_reduces_its_buffer_once_after_the_backward():
    job = plan(dp=32, dp_compress="bf16")
    torch_ddp, local = megatron_lm(A100, torch_ddp=True), megatron_lm(A100)
    assert not torch_ddp.dp_after_backward and not torch_ddp.dp_one_collective
    assert local.dp_after_backward and local.dp_one_collective
    during, after = predict_step(job, torch_ddp), predict_step(job, local)
    assert after.dp_exposed_s == after.dp_s and after.dp_contention_s == 0
    assert during.dp_exposed_s < 0.5 * during.dp_s and during.dp_contention_s > 0
    # the same bytes; the buckets' ring latency paid once, not once per 25 MB
    link = link_for(job, A100, "dp")
    grads = 2 * max(est.params for est in job.memory)
    assert after.dp_s == pytest.approx(ring_all_reduce(grads, 32, link))
    buckets = -(-grads // (25 * 2**20))
    assert during.dp_s - after.dp_s == pytest.approx(2 * 31 * link.latency * (buckets - 1))


def test_the_2021_scripts_fp16_step_unscales_the_gradients():
    per_byte = 1 / A100.memory_bandwidth
    assert megatron_lm(A100).optimizer_s_per_param == pytest.approx(
        (MIXED_PRECISION_STEP_BYTES + LOCAL_DDP_BYTES) * per_byte)
    assert megatron_lm(A100, torch_ddp=True, fp16=True).optimizer_s_per_param == pytest.approx(
        (MIXED_PRECISION_STEP_BYTES + FP16_UNSCALE_BYTES + TORCH_DDP_BYTES) * per_byte)


def test_hybrid_plan_says_what_the_hidden_reduction_costs_the_compute():
    from launch.commands.plan import prediction_line

    said = {"device": "a100-80gb", "software": "hybrid", "assumes": "predictions assume ..."}
    hidden = prediction_line(predict_step(plan(), A100).to_dict() | said)
    assert "compute lost beside it" in hidden
    after = predict_step(plan(), replace(A100, dp_after_backward=True)).to_dict() | said
    assert "compute lost beside it" not in prediction_line(after)


def test_the_reductions_latency_is_paid_once_a_bucket_of_the_configured_size():
    default, halved = plan(dp=32), plan(dp=32, bucket_mb=12.5)
    link = link_for(default, A100, "dp")
    grads = 4 * max(est.params for est in default.memory)  # fp32, hybrid's exact reduction
    buckets = [-(-grads // (mb * 2**20)) for mb in (25, 12.5)]
    extra = predict_step(halved, A100).dp_s - predict_step(default, A100).dp_s
    assert extra == pytest.approx(2 * 31 * link.latency * (buckets[1] - buckets[0]))
