"""DualPipeV (issue 54): hybrid's lists against torch's own ``ScheduleDualPipeV``, and the
schedule through the checker, the simulator and the validation."""

from __future__ import annotations

import pytest

from hybrid.planning.schedules import add_communication, batch_problem, build_schedule
from hybrid.planning.schedules.actions import (
    V_SHAPE, Action, Composite, ScheduleError, from_text, to_text,
)
from hybrid.planning.schedules.dualpipev import dualpipev_steps
from hybrid.planning.schedules.simulate import Costs, simulate
from hybrid.planning.schedules.check import check_schedule
from hybrid.planning.schedules.shapes import closed_form_schedule, simulate_unit_costs


def _torch_pipeline_order(pp: int, m: int, composite: bool = False) -> list[list]:
    """torch 2.13's ``ScheduleDualPipeV`` per-rank compute order, each overlapped pair
    (``OVERLAP_F_B``) written as its sub-actions in order. Its constructor needs live stages
    and a process group only to learn ``pp`` and ``m``; the order itself is computed by
    ``_calculate_single_rank_operations`` from those two numbers, which is what we call."""
    from torch.distributed.pipelining.schedules import (
        OVERLAP_F_B, ScheduleDualPipeV, _ComputationType,
    )
    schedule = object.__new__(ScheduleDualPipeV)
    schedule.pp_group_size, schedule._n_microbatches = pp, m
    lists = []
    for rank in range(pp):
        actions = []
        for action in schedule._calculate_single_rank_operations(rank):
            parts = action.sub_actions if action.computation_type == OVERLAP_F_B else (action,)
            ours = [Action(part.stage_index, _ComputationType(part.computation_type).value,
                           part.microbatch_index) for part in parts]
            if composite and len(ours) > 1:
                actions.append(Composite(tuple(ours)))
            else:
                actions += ours
        lists.append(actions)
    return lists


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("per_pp", [2, 4])
def test_dualpipev_lists_equal_torch_schedule_dualpipev_rank_by_rank(pp, per_pp):
    m = per_pp * pp
    ours = build_schedule("dualpipev", pp, m, vpp=2)
    theirs = _torch_pipeline_order(pp, m)
    for rank in range(pp):
        assert ours[rank] == theirs[rank], rank
    assert any(a.kind == "B" for a in ours[0]) and any(a.kind == "I" for a in ours[0])
    steps, composites = dualpipev_steps(pp, m), _torch_pipeline_order(pp, m, composite=True)
    assert steps == composites
    assert sum(isinstance(step, Composite) for step in steps[0]) > 0


def test_composite_actions_round_trip_as_text_and_check_and_time_as_their_parts():
    steps = dualpipev_steps(2, 4)
    assert "0F3+3B1" in to_text(steps) and from_text(to_text(steps)) == steps
    check_schedule(steps, 2, 4, 2, V_SHAPE)
    flat = build_schedule("dualpipev", 2, 4, vpp=2)
    assert simulate(steps, 2, 4, 2, placement=V_SHAPE).events == simulate(
        flat, 2, 4, 2, placement=V_SHAPE).events
    with pytest.raises(ScheduleError, match="two or more compute"):
        Composite((Action(0, "F", 0), Action(0, "SEND_F", 0)))
    check_schedule([[Composite((Action(0, "F", 0), Action(0, "B", 0)))]], 1, 1)
    with pytest.raises(ScheduleError, match="0B0 runs before 0F0"):  # parts run in order
        check_schedule([[Composite((Action(0, "B", 0), Action(0, "F", 0)))]], 1, 1)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("per_pp", [2, 3, 4])
def test_dualpipev_is_complete_and_deadlock_free_compute_only_and_lowered(pp, per_pp):
    m = per_pp * pp
    lists = build_schedule("dualpipev", pp, m, vpp=2)
    check_schedule(lists, pp, m, 2, V_SHAPE)
    check_schedule(add_communication(lists, pp, 2, V_SHAPE), pp, m, 2, V_SHAPE)


def test_dualpipev_refuses_fewer_than_two_microbatches_per_rank_in_one_line():
    with pytest.raises(ScheduleError, match=r"at least 8 micro-batches"):
        build_schedule("dualpipev", 4, 6, vpp=2)
    with pytest.raises(ScheduleError, match="exactly 2 chunks"):
        build_schedule("dualpipev", 2, 4, vpp=1)
    problem = batch_problem("dualpipev", pp=4, m=6, how="global_batch 12 / micro_batch 2")
    assert problem is not None and "\n" not in problem and "at least 8" in problem
    assert batch_problem("dualpipev", pp=4, m=8, how="") is None


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("per_pp", [2, 3, 4])
def test_dualpipev_bubble_and_peak_inflight_equal_their_closed_forms(pp, per_pp):
    """Unit costs F=1, B=2, I=W=1, a pair's parts serialised (the CPU runtime): the makespan
    is ZB-V's 6m + pp - 1, and every rank holds 2pp + 1 chunk activations at its peak."""
    m = per_pp * pp
    sim = simulate_unit_costs("dualpipev", pp, m, 2)
    assert sim.makespan == 6 * m + pp - 1
    assert sim.peak_inflight == (2 * pp + 1,) * pp
    bubble, peak = closed_form_schedule("dualpipev", pp, m, 2)
    assert bubble == pytest.approx(sim.bubble_fraction) and peak == sim.peak_inflight


def _pairs_waiting_for_both_inputs(pp: int, m: int) -> list[list]:
    """DualPipeV's lowered lists with each composite's second RECV moved in front of its first
    part: the pair starts only once both parts' inputs are in, as DeepSeek's reference and
    torch's ``OVERLAP_F_B`` run it (hybrid's runtime lets each part wait for its own)."""
    steps = dualpipev_steps(pp, m)
    lowered = add_communication(steps, pp, 2, V_SHAPE)
    for rank, rank_steps in enumerate(steps):
        actions = lowered[rank]
        for forward, backward in (s.parts for s in rank_steps if isinstance(s, Composite)):
            recv = Action(backward.stage, "RECV_B", backward.mb)
            if recv in actions:
                actions.remove(recv)
                own = Action(forward.stage, "RECV_F", forward.mb)
                actions.insert(actions.index(own if own in actions else forward), recv)
    return lowered


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_dualpipev_idles_the_papers_bubble_when_a_pair_waits_for_both_inputs(pp, m):
    """DeepSeek-V3's Table 2 (and DeepSeek's DualPipe README for the V form) gives DualPipeV's
    bubble as (PP/2 - 1)(F&B + B - 3W) on PP/2 devices of two chunks: here (pp - 1) times
    that, with chunk costs F=1, B=2, W=1 and F&B = F + B (parts in order): 2(pp - 1) idle a
    rank. Held so, the simulation gives exactly that; hybrid's order (each part waits only for
    its own input, so a pair's F runs while its B's input is on the way) idles half, ZB-V's
    (pp - 1)F, which is what the cost model and the closed form price."""
    unit = Costs(F=1, B=2, I=1, W=1)
    paper = (pp - 1) * ((unit.F + unit.B) + unit.B - 3 * unit.W)
    atomic = simulate(_pairs_waiting_for_both_inputs(pp, m), pp, m, 2, unit, V_SHAPE)
    assert atomic.bubble_time == (paper,) * pp
    ours = simulate(build_schedule("dualpipev", pp, m, 2), pp, m, 2, unit, V_SHAPE)
    assert ours.bubble_time == ((pp - 1) * unit.F,) * pp == (paper / 2,) * pp


def _table_rows() -> list[list[str]]:
    """docs/pipeline.md's "DualPipeV beside ZB-V and 1F1B" table, row by row."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "pipeline.md").read_text()
    section = text.split("### DualPipeV beside ZB-V and 1F1B", 1)[1].split("###", 1)[0]
    return [[cell.strip() for cell in line.strip("|").split("|")]
            for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(("| schedule", "| ---"))]


CLOSED_FORMS = {  # (pp, m) -> (bubble, peak in-flight per rank, whole-model activations held)
    "1f1b": lambda pp, m: ((pp - 1) / (m + pp - 1), [min(pp - r, m) for r in range(pp)],
                           [min(pp - r, m) / pp for r in range(pp)]),
    "zb-v": lambda pp, m: ((pp - 1) / (6 * m + pp - 1),
                           [min(2 * pp, 2 * m, m + 1 + r) for r in range(pp)],
                           [min(2 * pp, 2 * m, m + 1 + r) / (2 * pp) for r in range(pp)]),
    "dualpipev": lambda pp, m: ((pp - 1) / (6 * m + pp - 1), [2 * pp + 1] * pp,
                                [(2 * pp + 1) / (2 * pp)] * pp),
}


def _activations(cell: str, pp: int) -> list[float]:
    """``"A, 3A/4"`` or ``"9A/8 on every rank"`` -> multiples of A per rank."""
    from fractions import Fraction

    words = cell.replace(" on every rank", "").split(", ")
    values = [float(Fraction(w.replace("A", "1") if w.startswith("A") else
                             w.replace("A", ""))) for w in words]
    return values * pp if len(values) == 1 else values


def test_docs_table_of_dualpipev_zb_v_and_1f1b_is_the_simulation_and_the_closed_forms():
    rows = _table_rows()
    assert {(r[0], int(r[1]), int(r[2])) for r in rows} == {
        (name, pp, m) for name in CLOSED_FORMS for pp, m in ((4, 8), (4, 16), (2, 4))}
    for name, pp, m, _, bubble, peak, held in rows:
        pp, m, vpp = int(pp), int(m), 1 if name == "1f1b" else 2
        sim = simulate_unit_costs(name, pp, m, vpp)
        closed_bubble, closed_peak, closed_held = CLOSED_FORMS[name](pp, m)
        assert sim.bubble_fraction == pytest.approx(closed_bubble), (name, pp, m)
        assert list(sim.peak_inflight) == closed_peak, (name, pp, m)
        assert f"{100 * sim.bubble_fraction:.1f}%" == bubble
        assert [int(x) for x in peak.split(" (")[0].split(", ")] == closed_peak
        assert _activations(held, pp) == pytest.approx(closed_held), (name, pp, m)


def test_hybrid_plan_draws_dualpipev_with_its_composites_whole():
    from hybrid.planning.config import Config, LauncherConfig, ModelConfig, ParallelConfig, \
        TrainConfig
    from hybrid.planning.view import build_plan, format_plan

    cfg = Config(model=ModelConfig(layers=4), train=TrainConfig(global_batch=8, micro_batch=2),
                 parallel=ParallelConfig(pp=2, vpp=2, schedule="dualpipev"),
                 launcher=LauncherConfig(nproc_per_node=None))
    plan = build_plan(cfg)
    assert plan["schedule"]["steps"] == [[str(s) for s in steps]
                                         for steps in dualpipev_steps(2, 4)]
    drawn = format_plan(plan, full=True)
    assert "step | rank 0" in drawn and " 0F3+3B1 " in drawn
    assert "step | rank 0" not in format_plan(plan)
