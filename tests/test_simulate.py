"""The simulator against the closed forms of each schedule's bubble and memory.

All costs are ``Fraction``s, so every closed form below is tested for exact equality.
Costs are per virtual stage (one chunk): interleaved runs use ``Costs.per_chunk(v)``, i.e. the
same model cut into v times thinner stages.
"""

from fractions import Fraction as Fr

import pytest

from hybrid.planning.schedules.actions import V_SHAPE, ScheduleError
from hybrid.planning.schedules import schedule_names, add_communication, build_schedule
from hybrid.planning.schedules.simulate import Costs, peak_inflight, simulate

SIZES = [(p, m) for p in (2, 3, 4, 8) for m in sorted({p, 2 * p, 4 * p, 8})]
SMALL_M = [(p, m) for p in (2, 3, 4, 8) for m in (1, 3, 5) if m < p]


def _costs(F=1, B=2, I=1, W=1, p2p=0):  # noqa: E741 - the action letters
    return Costs(F=Fr(F), B=Fr(B), I=Fr(I), W=Fr(W), p2p=Fr(p2p))


def _run(name, p, m, v=1, costs=None, lowered=False):
    lists = build_schedule(name, p, m, v)
    if lowered:
        lists = add_communication(lists, p, v)
    return simulate(lists, p, m, v, costs or _costs())


@pytest.mark.parametrize("p,m", SIZES + SMALL_M)
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_1f1b_and_gpipe_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    result = _run(name, p, m, costs=_costs(F=1, B=1))
    assert result.bubble_per_rank == (Fr(p - 1, m + p - 1),) * p
    assert result.bubble_fraction == Fr(p - 1, m + p - 1)
    # with the fused backward twice the forward the bubble *time* is (p-1)(F+B)
    assert _run(name, p, m, costs=_costs(F=1, B=2)).bubble_time == (3 * (p - 1),) * p


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SIZES if m % p == 0])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("F,B", [(1, 1), (1, 2)])
def test_interleaving_divides_the_bubble_time_by_v(p, m, v, F, B):
    """Exact for Megatron's order with each chunk costing 1/v of a stage: bubble time
    (p-1)(F+B)/v against 1F1B's (p-1)(F+B); with F == B that is the fraction (p-1)/(v*m+p-1)."""
    interleaved = _run("interleaved-1f1b", p, m, v, _costs(F=F, B=B).per_chunk(v))
    one_f_one_b = _run("1f1b", p, m, costs=_costs(F=F, B=B))
    assert one_f_one_b.bubble_time == ((p - 1) * (F + B),) * p
    assert interleaved.bubble_time == (Fr((p - 1) * (F + B), v),) * p
    assert interleaved.makespan == m * (F + B) + Fr((p - 1) * (F + B), v)
    if F == B:
        assert interleaved.bubble_fraction == Fr(p - 1, v * m + p - 1)


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("F,I,W", [(1, 1, 1), (2, 2, 1), (1, 2, 1), (2, 1, 1), (3, 4, 2)])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_i_minus_w(p, m, F, I, W):  # noqa: E741
    """For m >= p (and W <= F): ZB-H1 idles (p-1)(F+I-W) against 1F1B's (p-1)(F+B), B = I+W;
    a third of it when F = I = W."""
    costs = _costs(F=F, B=I + W, I=I, W=W)
    zero_bubble = _run("zb-h1", p, m, costs=costs)
    one_f_one_b = _run("1f1b", p, m, costs=costs)
    assert zero_bubble.bubble_time == ((p - 1) * (F + I - W),) * p
    assert one_f_one_b.bubble_time == ((p - 1) * (F + I + W),) * p
    if F == I == W:
        assert 3 * zero_bubble.bubble_time[0] == one_f_one_b.bubble_time[0]


@pytest.mark.parametrize("p,m", SIZES + SMALL_M)
def test_peak_inflight_gpipe_holds_all_1f1b_and_zb_h1_hold_at_most_p(p, m):
    assert _run("gpipe", p, m).peak_inflight == (m,) * p
    expected = tuple(min(p - rank, m) for rank in range(p))
    assert _run("1f1b", p, m).peak_inflight == expected
    # ZB-H1 holds a micro-batch from F until its W: min(p, m) on every rank, which is the
    # first rank's 1F1B peak (the bound of Qi et al.), and more than 1F1B on later ranks.
    assert _run("zb-h1", p, m).peak_inflight == (min(p, m),) * p


@pytest.mark.parametrize("p,m", [(4, 8), (2, 4), (3, 6), (8, 16)])
def test_zb_v_halves_zb_h1_bubble_at_1f1b_activation_memory(p, m):
    """With F = I = W per stage (so F = I = W = 1/2 per V chunk), ZB-V idles one chunk's F per
    warm-up step, (p-1)/2, half ZB-H1's (p-1); each rank holds at most 2p chunk activations,
    i.e. p micro-batches of a whole stage: 1F1B's first-rank peak."""
    costs = _costs(F=1, B=2, I=1, W=1)
    zb_v = simulate(build_schedule("zb-v", p, m, 2), p, m, 2, costs.per_chunk(2),
                    placement=V_SHAPE)
    zb_h1 = _run("zb-h1", p, m, costs=costs)
    assert zb_v.bubble_fraction < zb_h1.bubble_fraction
    assert zb_v.bubble_time == (Fr(p - 1, 2),) * p and zb_h1.bubble_time == (p - 1,) * p
    assert max(zb_v.peak_inflight) == 2 * p == 2 * max(_run("1f1b", p, m).peak_inflight)


def test_peak_inflight_counts_each_chunk_separately():
    lists = build_schedule("interleaved-1f1b", 2, 4, 2)
    # rank 0 warms up 2*(pp-1) + (vpp-1)*pp = 4 forwards, then one more before its first B
    assert peak_inflight(lists[0]) == 5


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                                    ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("p2p", [0, Fr(1, 4)])
def test_lowered_lists_time_like_compute_only_lists(name, v, p2p):
    costs = _costs(p2p=p2p)
    plain, lowered = _run(name, 4, 8, v, costs), _run(name, 4, 8, v, costs, lowered=True)
    assert lowered.makespan == plain.makespan
    assert lowered.bubble_time == plain.bubble_time


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (3, 5)])
def test_gpipe_pays_each_message_on_the_way_down_and_up(p, m):
    c = Fr(1, 4)
    result = _run("gpipe", p, m, costs=_costs(F=1, B=2, p2p=c))
    assert result.bubble_time == ((p - 1) * (1 + 2 + 2 * c),) * p


def test_events_cover_every_action_without_overlap_on_a_rank():
    lists = add_communication(build_schedule("zb-h1", 4, 8), 4, 1)
    result = simulate(lists, 4, 8, costs=_costs(p2p=Fr(1, 2)))
    assert len(result.events) == sum(len(actions) for actions in lists)
    for rank in range(4):
        mine = [(start, end, action) for r, action, start, end in result.events if r == rank]
        assert [action for _, _, action in mine] == lists[rank]
        assert all(end <= next_start for (_, end, _), (next_start, _, _) in zip(mine, mine[1:]))
    assert max(end for _, _, _, end in result.events) == result.makespan
    assert result.busy == (8 * 3,) * 4


def test_costs_per_chunk_divides_compute_but_not_latency():
    assert _costs(F=2, B=4, I=2, W=2, p2p=1).per_chunk(2) == _costs(F=1, B=2, I=1, W=1, p2p=1)


def test_simulate_checks_the_schedule_first():
    lists = build_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="missing"):
        simulate([lists[0][:-1], lists[1]], 2, 2)


def test_closed_form_schedule_shapes_equal_the_simulation():
    """What the layout search uses instead of simulating thousands of schedules."""
    from hybrid.planning.schedules.shapes import closed_form_schedule, simulate_unit_costs

    checked = 0
    for name in schedule_names():
        for pp in range(1, 7):
            for vpp in {"interleaved-1f1b": (2, 3), "zb-v": (2,)}.get(name, (1,)):
                for m in range(1, 13):
                    try:
                        sim = simulate_unit_costs(name, pp, m, vpp)
                    except ScheduleError:
                        continue  # not a valid shape for this schedule
                    bubble, peak = closed_form_schedule(name, pp, m, vpp)
                    assert peak == tuple(sim.peak_inflight), (name, pp, m, vpp)
                    if (name != "zb-h1" or m >= pp) and (name != "zb-v" or m >= 2 * pp):
                        assert bubble == pytest.approx(sim.bubble_fraction), (name, pp, m, vpp)
                    checked += 1
    assert checked > 150
