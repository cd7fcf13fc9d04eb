"""DualPipeV priced (issue 54): on a GPU a composite's parts run on two streams, so each one's
communication hides under the other's compute; on a CPU host they run in order and the
overlap gains nothing. The search proposes dualpipev to hybrid's profile, not Megatron-LM 2021's."""

from dataclasses import replace

import pytest

from hybrid.planning.config import Config, ModelConfig, TrainConfig
from hybrid.planning.cost.devices import PRESETS
from hybrid.planning.cost.makespan import (_overlapped_pairs, overlap_savings, pair_time,
                                           simulated_makespan)
from hybrid.planning.cost.search import search, searched_schedules
from hybrid.planning.cost.search_limits import SearchLimits
from hybrid.planning.cost.software import HYBRID, MEGATRON_LM_2021
from hybrid.planning.cost.stage_time import StageTimes
from hybrid.planning.cost.steptime import _parts, predict_step, step_lower_bound
from hybrid.planning.job import plan_job

A100, CPU = PRESETS["a100-80gb"], PRESETS["cpu"]
MOE = ModelConfig(name="moe", family="llama", layers=8, hidden=1024, heads=16, vocab=32000, seq_len=1024,
                  experts=8, experts_topk=2)


def config(schedule: str, **parallel) -> Config:
    cfg = Config(model=MOE, train=TrainConfig(global_batch=16, micro_batch=1,
                                              precision="bf16"))
    vpp = 1 if schedule == "1f1b" else 2
    cfg.parallel = replace(cfg.parallel, schedule=schedule, vpp=vpp, **parallel)
    return cfg


def test_a_pair_hides_each_parts_communication_under_the_others_compute():
    forward = StageTimes(forward=3.0, backward=0.0, tp_comm=0, tp_wire=0, comm_forward=1.0)
    backward = StageTimes(forward=0.0, backward=5.0, tp_comm=0, tp_wire=0, comm_backward=2.0)
    assert pair_time(forward, backward) == 5.0  # 2 + 3 of compute; 1 and 2 hidden
    long_comm = replace(backward, backward=9.0, comm_backward=6.0)  # 6 > the forward's 2
    assert pair_time(forward, long_comm) == 2 + 3 + (6 - 2)
    silent = replace(backward, comm_backward=0.0)
    assert pair_time(replace(forward, comm_forward=0.0), silent) == 3.0 + 5.0


@pytest.mark.parametrize("parallel", [dict(pp=2, tp=2), dict(pp=2, dp=2, ep=2)])
def test_the_overlap_gains_on_a_gpu_and_nothing_on_a_cpu(parallel):
    plan = plan_job(config("dualpipev", **parallel))
    gpu = _parts(plan, A100)
    assert all(saved > 0 for saved in overlap_savings(plan, gpu.times))
    overlapped = simulated_makespan(plan, gpu.times, gpu.p2p, overlap=True)
    assert overlapped < simulated_makespan(plan, gpu.times, gpu.p2p, overlap=False)
    assert step_lower_bound(plan, A100) <= predict_step(plan, A100).step_time_s
    cpu = _parts(plan, CPU)
    assert cpu.busy == [r.busy for r in cpu.ranks]  # a host runs the parts in order
    zb_v = plan_job(config("zb-v", **parallel))
    assert overlap_savings(zb_v, _parts(zb_v, A100).times) == [0.0, 0.0]  # no composites


def test_the_search_proposes_dualpipev_to_hybrid_not_to_megatron_lm_2021():
    assert ("dualpipev", 2) in searched_schedules(4, SearchLimits(software=HYBRID))
    assert ("dualpipev", 2) not in searched_schedules(
        4, SearchLimits(software=MEGATRON_LM_2021))
    cfg = config("1f1b")
    found = search(cfg, 4, A100, top=200, limits=SearchLimits(software=HYBRID))
    schedules = {c["settings"]["schedule"] for c in found["candidates"]}
    assert "dualpipev" in schedules


def test_the_counted_pairs_are_the_composites_of_the_built_lists():
    """``dualpipev_pairs`` (what the cost model prices, counted without building a list)
    equals the F+B composites of ``dualpipev_steps``, rank by rank, on every shape the
    search can ask for from pp 1 to 8; and a pair's saving priced from the counts equals
    the saving summed over the built composites."""
    from collections import Counter

    from hybrid.planning.schedules.actions import Composite
    from hybrid.planning.schedules.dualpipev import dualpipev_pairs, dualpipev_steps

    for pp in range(1, 9):
        for m in range(2 * pp, 2 * pp + 9):
            built = [Counter((s.parts[0].stage, s.parts[1].stage) for s in steps
                             if isinstance(s, Composite)) for steps in dualpipev_steps(pp, m)]
            counted = [{(f, b): n for f, b, n in held} for held in dualpipev_pairs(pp, m)]
            assert counted == [dict(c) for c in built], (pp, m)
    assert any(dualpipev_pairs(4, 8))  # not vacuous: the steady state pairs
    plan = plan_job(config("dualpipev", pp=4))
    times = _parts(plan, A100).times
    per_rank = [0.0] * 4
    for rank, _, saving in _overlapped_pairs(plan, times):  # over the built composites
        per_rank[rank] += saving
    assert overlap_savings(plan, times) == pytest.approx(per_rank, rel=1e-12)
