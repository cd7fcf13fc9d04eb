"""ZeRO-3's gathers and releases as schedule data (pure), and what the plan predicts of them.

Training parity, the counted bytes and the gathered peak of real runs: ``test_train_e2e``;
checkpoints to and from ZeRO-3: ``test_checkpoint_e2e``.
"""

import pytest

from hybrid.planning.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hybrid.planning.cost.gathered import rank_gathers
from hybrid.planning.job import plan_job
from hybrid.planning.layout import LayoutError
from hybrid.planning.schedules import add_communication, build_schedule, schedule_placement
from hybrid.planning.schedules.actions import RESHARD, UNSHARD, Action, ScheduleError
from hybrid.planning.schedules.check import check_schedule
from hybrid.planning.schedules.gathers import (
    AFTER_FORWARD, AFTER_STEP, add_gathers, check_gathers, needs_weights, unshard_directions,
    walk_gathers,
)
from hybrid.planning.schedules.rank_check import plan_rank
from hybrid.planning.validate import validate_config

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)]


def _gathered(name: str, vpp: int, policy: str, pp: int = 2, m: int = 4):
    placement = schedule_placement(name)
    lowered = add_communication(build_schedule(name, pp, m, vpp=vpp), pp, vpp, placement)
    return add_gathers(lowered, policy), placement


@pytest.mark.parametrize("policy", [AFTER_FORWARD, AFTER_STEP])
@pytest.mark.parametrize("name, vpp", SCHEDULES)
def test_every_schedule_with_gathers_is_checked_whole_and_per_rank(name, vpp, policy):
    pp, m = 2, 4
    lists, placement = _gathered(name, vpp, policy, pp, m)
    check_schedule(lists, pp, m, vpp, placement)
    for rank, actions in enumerate(lists):
        stages = sorted({a.stage for a in actions})
        plan_rank(actions, stages, rank=rank, pp=pp, vpp=vpp, m=m, placement=placement)
        per_stage = {s: sum(a.kind == UNSHARD and a.stage == s for a in actions)
                     for s in stages}
        # after_forward: one gather per forward and one per backward that needs the weights
        # (I, or stage 0's deferred W); after_step: one a step
        expected = 2 * m if policy == AFTER_FORWARD else 1
        assert set(per_stage.values()) == {expected}, (rank, per_stage)


def test_a_compute_without_its_gather_is_refused_in_one_line():
    lists, placement = _gathered("1f1b", 1, AFTER_FORWARD)
    broken = [list(actions) for actions in lists]
    first = next(i for i, a in enumerate(broken[1]) if a.kind == UNSHARD)
    del broken[1][first]
    with pytest.raises(ScheduleError, match=r"rank 1 step \d+: 1F0 runs without its stage's "
                                            r"weights; put 1UNSHARD0 before it"):
        check_schedule(broken, 2, 4, 1, placement)


def test_gathering_twice_releasing_unheld_and_leaving_gathered_are_refused():
    f0, unshard, reshard = Action(0, "F", 0), Action(0, UNSHARD, 0), Action(0, RESHARD, 0)
    with pytest.raises(ScheduleError, match="gathers stage 0, which is gathered already"):
        check_gathers([unshard, unshard, f0, reshard], rank=0)
    with pytest.raises(ScheduleError, match="releases stage 0, which is not gathered"):
        check_gathers([reshard], rank=0)
    with pytest.raises(ScheduleError, match=r"ends the step with stages \[0\] still gathered"):
        check_gathers([unshard, f0], rank=0)


def test_weight_gradients_need_the_weights_only_where_the_whole_backward_waits():
    assert needs_weights(Action(1, "F", 0)) and needs_weights(Action(1, "B", 0))
    assert needs_weights(Action(1, "I", 0)) and not needs_weights(Action(1, "W", 0))
    assert not needs_weights(Action(0, "I", 0)) and needs_weights(Action(0, "W", 0))
    assert not needs_weights(Action(1, "SEND_F", 0))


def test_the_next_stage_starts_gathering_behind_the_current_compute():
    lists, _ = _gathered("interleaved-1f1b", 2, AFTER_FORWARD)
    actions = [a for a in lists[0] if a.is_compute or a.is_shard]
    prefetched = [i for i, a in enumerate(actions[:-1])
                  if a.kind == UNSHARD and actions[i + 1].is_compute
                  and actions[i + 1].stage != a.stage]
    assert prefetched, lists[0]
    directions = unshard_directions(actions)
    assert len(directions) == sum(a.kind == UNSHARD for a in actions)
    assert set(directions) == {+1, -1}  # forwards start at the first block, backwards last


def test_a_compute_gathers_one_block_and_the_next_one_behind_it():
    """Three blocks in buckets of their own (1, 10, 100 bytes) on stage 1: a forward and a
    backward gather each block once under after_forward, never more than two at once; under
    after_step each block once a step, all three held."""
    units = {1: [frozenset({0}), frozenset({1}), frozenset({2})]}
    actions = [Action(1, UNSHARD, 0), Action(1, "F", 0), Action(1, RESHARD, 0),
               Action(1, UNSHARD, 0), Action(1, "B", 0), Action(1, RESHARD, 0)]
    assert walk_gathers(actions, units, [1, 10, 100], AFTER_FORWARD) == (110, [2, 2, 2])
    once = [Action(1, UNSHARD, 0), Action(1, "F", 0), Action(1, "B", 0), Action(1, RESHARD, 0)]
    assert walk_gathers(once, units, [1, 10, 100], AFTER_STEP) == (111, [1, 1, 1])
    assert str(Action.parse("2UNSHARD3")) == "2UNSHARD3"


def test_a_bucket_two_stages_use_is_gathered_once_and_freed_with_the_last():
    """Stage 0's one block and stage 2's one block share bucket 1 (it straddles the chunks);
    stage 0's backward keeps its first block (no input gradient frees it) until RESHARD."""
    units = {0: [frozenset({0, 1})], 2: [frozenset({1, 2})]}
    actions = [Action(0, UNSHARD, 0), Action(2, UNSHARD, 0), Action(0, "F", 0),
               Action(2, "F", 0), Action(2, RESHARD, 0), Action(0, "B", 0),
               Action(0, RESHARD, 0)]
    peak, gathers = walk_gathers(actions, units, [100, 10, 1000], AFTER_STEP)
    assert peak == 1110 and gathers == [1, 1, 1]
    # after_forward: each UNSHARD starts its stage's first block (both held at once), each
    # forward frees its block, the backward gathers stage 0's again
    peak, gathers = walk_gathers(actions, units, [100, 10, 1000], AFTER_FORWARD)
    assert peak == 1110 and gathers == [2, 2, 1]


def _cfg(policy: str, **parallel) -> Config:
    return Config(model=ModelConfig(layers=8),
                  parallel=ParallelConfig(**{"dp": 2, "pp": 2, "vpp": 2, "zero": 3,
                                             "schedule": "interleaved-1f1b",
                                             "bucket_mb": 0.02, "zero3_reshard": policy,
                                             **parallel}),
                  train=TrainConfig(global_batch=8, micro_batch=2))


def test_after_step_holds_more_and_gathers_less_than_after_forward():
    """after_forward holds a block and the next one; after_step every block of the rank."""
    walks = {}
    for policy in (AFTER_FORWARD, AFTER_STEP):
        plan = plan_job(_cfg(policy))
        stages = [(st.index, list(st.blocks)) for st in plan.stages_of(0)]
        walks[policy] = rank_gathers(plan.cfg, plan.layout, 0, plan.schedule.microbatches,
                                     stages)
        assert plan.memory[0].gathered_bytes == walks[policy][0]
    (held_f, gathers_f), (held_s, gathers_s) = walks[AFTER_FORWARD], walks[AFTER_STEP]
    assert held_s > held_f > 0
    assert sum(gathers_f) > sum(gathers_s) == len(gathers_s)  # after_step: each bucket once


def test_zero3_settings_are_checked_before_launch_in_one_line():
    with pytest.raises(LayoutError, match="parallel.zero3_reshard='never' is unknown; choose "
                                          "one of after_forward, after_step"):
        validate_config(_cfg("never"))
    with pytest.raises(LayoutError, match="parallel.zero=3 runs with exact reduction only, "
                                          "not parallel.dp_compress=bf16"):
        validate_config(_cfg(AFTER_FORWARD, dp_compress="bf16"))


def test_the_search_picks_zero3_where_only_it_fits():
    """On a device too small for any layout at ZeRO 0-2, the search's answers are ZeRO-3's
    (and where ZeRO-2 fits, the search does not try ZeRO-3: it is never faster)."""
    from dataclasses import replace

    from hybrid.planning.cost.devices import PRESETS
    from hybrid.planning.cost.search import LOWER_STAGE_FITS, candidates, search

    # One layer and one head leave no pipeline nor tensor split: 8 devices are 8 replicas,
    # and the two vocabulary matrices are most of the weights.
    cfg = Config(model=ModelConfig(layers=1, hidden=256, heads=1, seq_len=64, vocab=32768),
                 train=TrainConfig(global_batch=32, micro_batch=1, precision="bf16"))
    least: dict[int, int] = {}
    for candidate in candidates(cfg, 8):
        try:
            plan = plan_job(candidate, simulated=False)
        except LayoutError:
            continue
        need = max(est.total_bytes for est in plan.memory)
        zero = candidate.parallel.zero
        least[zero] = min(least.get(zero, need), need)
    below = min(least[zero] for zero in (0, 1, 2))
    assert least[3] < below
    small = replace(PRESETS["a100-80gb"], memory_bytes=(least[3] + below) // 2)
    found = search(cfg, 8, small, top=3)
    assert found["candidates"]
    assert {c["settings"]["zero"] for c in found["candidates"]} == {3}
    roomy = search(cfg, 8, PRESETS["a100-80gb"], top=3)
    assert roomy["rejected"][LOWER_STAGE_FITS] > 0
    assert 3 not in {c["settings"]["zero"] for c in roomy["candidates"]}
