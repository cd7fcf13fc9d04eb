"""The stage map (stage -> rank, any shape): the built-in loop and V keep their formulas, and a
map of a user's own runs through the checker, the simulator, the lowering and the per-rank
checks, registered by name or given as an explicit ``StageMap`` (no processes)."""

import pytest

from hybrid.planning.layout import Layout, LayoutError
from hybrid.planning.schedules import add_communication, build_schedule, register_schedule
from hybrid.planning.schedules import stage_map as sm
from hybrid.planning.schedules.actions import ScheduleError
from hybrid.planning.schedules.check import check_schedule
from hybrid.planning.schedules.rank_check import plan_rank
from hybrid.planning.schedules.registry import SCHEDULES, ScheduleSpec, schedule_spec
from hybrid.planning.schedules.simulate import simulate
from hybrid.planning.schedules.stage_map import (
    LOOP, V_SHAPE, StageMap, rank_stages, stage_chunk, stage_map, stage_rank,
)


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("vpp", [1, 2, 3])
def test_loop_and_v_are_the_formulas_they_were(pp, vpp):
    for s in range(pp * vpp):
        assert stage_rank(s, pp, LOOP) == s % pp
        v_rank = pp - 1 - s % pp if (s // pp) % 2 else s % pp
        assert stage_rank(s, pp, V_SHAPE) == v_rank
        for placement in (LOOP, V_SHAPE):
            assert stage_chunk(s, pp, placement) == s // pp
            table = stage_map(placement, pp, vpp)
            assert rank_stages(table.ranks[s], pp, vpp, table)[s // pp] == s


def _reversed_loop(stage: int, pp: int) -> int:
    """Stage s on rank -s mod pp: the loop run the other way round (stage 0 stays on 0)."""
    return (-stage) % pp


def _relabelled_1f1b(pp: int, m: int, vpp: int = 1) -> list:
    lists = build_schedule("1f1b", pp, m)
    return [lists[(-r) % pp] for r in range(pp)]


@pytest.fixture
def reversed_loop(monkeypatch):
    monkeypatch.setitem(sm.STAGE_RULES, "reversed", _reversed_loop)
    sm._rank_table.cache_clear()
    yield "reversed"
    sm._rank_table.cache_clear()


@pytest.mark.parametrize("pp,m", [(3, 3), (4, 6)])
def test_a_users_own_map_is_checked_simulated_and_lowered(reversed_loop, pp, m):
    lists = _relabelled_1f1b(pp, m)
    explicit = StageMap(tuple(_reversed_loop(s, pp) for s in range(pp)))
    for placement in (reversed_loop, explicit):
        check_schedule(lists, pp, m, 1, placement)
        lowered = add_communication(lists, pp, 1, placement)
        check_schedule(lowered, pp, m, 1, placement)
        assert lowered[1][0].kind == "RECV_F" and lowered[1][0].stage == pp - 1
        ours = simulate(lists, pp, m, placement=placement)
        loop = simulate(build_schedule("1f1b", pp, m), pp, m)
        assert (ours.makespan, sorted(ours.peak_inflight)) == (
            loop.makespan, sorted(loop.peak_inflight))
        for rank in range(pp):
            plan_rank(lists[rank], rank_stages(rank, pp, 1, placement), rank=rank, pp=pp,
                      vpp=1, m=m, placement=placement)
    with pytest.raises(ScheduleError, match="lives on rank"):
        check_schedule(lists, pp, m, 1, LOOP)


def test_a_schedule_module_declares_its_shape(reversed_loop, monkeypatch):
    spec = ScheduleSpec(name="reversed-1f1b", build=_relabelled_1f1b,
                        closed_form=schedule_spec("1f1b").closed_form,
                        warmup_step=schedule_spec("1f1b").warmup_step, placement=reversed_loop)
    monkeypatch.setitem(SCHEDULES, spec.name, spec)
    register_schedule(spec)
    assert build_schedule("reversed-1f1b", 3, 4)[1][0].stage == 2
    layout = Layout(dp=1, tp=1, pp=3, stage_placement=reversed_loop)
    assert layout.last_stage_pp_rank == 1
    with pytest.raises(LayoutError, match="stage_placement='nowhere'"):
        Layout(dp=1, tp=1, pp=3, stage_placement="nowhere")


def test_maps_that_cannot_run_are_refused_in_one_line():
    with pytest.raises(ScheduleError, match=r"\[2, 1\] stages"):
        StageMap((0, 1, 0))
    with pytest.raises(ScheduleError, match="needs pp=2 x vpp=2"):
        stage_map(StageMap((0, 1)), 2, 2)
    with pytest.raises(ScheduleError, match="keep the first stage on rank 0"):
        sm.register_stage_rule("shifted", lambda s, pp: (s + 1) % pp)
    assert "shifted" not in sm.STAGE_RULES
    with pytest.raises(ScheduleError, match="unknown placement 'nowhere'"):
        stage_rank(0, 2, "nowhere")
