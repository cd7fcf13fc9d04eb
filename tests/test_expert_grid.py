"""Expert parallelism's decomposition (pure, ``hybrid.planning.expert_grid``): its groups equal
megatron-core's expert ``RankGenerator``'s for every order and size tried, its pp groups are
the layout's, at ep=1 its expert data-parallel groups are the layout's dp x cp groups, and a
bad ep is one line."""

import itertools

import pytest

from hybrid.planning.expert_grid import check_ep, expert_groups
from hybrid.planning.layout import Layout, LayoutError, role_key

GROUPS = ["ep", "edp", "tp", "pp", "tp-ep", "tp-ep-pp", "ep-edp"]
MEGATRON = {"edp": "dp", "ep-edp": "ep-dp"}
"""Megatron's names for the expert data-parallel axis."""


def _cases():
    for tp, cp, dp, pp in itertools.product((1, 2), (1, 2), (1, 2, 4), (1, 2)):
        for ep in (d for d in (1, 2, 4) if (dp * cp) % d == 0):
            for order in ("tp-cp-dp-pp", "tp-cp-pp-dp", "tp-pp-cp-dp"):
                yield tp, cp, dp, pp, ep, order


def test_expert_groups_equal_megatron_rank_generator():
    from megatron.core.parallel_state import RankGenerator

    checked = refused = 0
    for tp, cp, dp, pp, ep, order in _cases():
        layout = Layout(dp=dp, cp=cp, tp=tp, pp=pp, order=order)
        try:
            check_ep(layout, ep)
        except LayoutError:  # megatron asserts against these (pipelines would differ)
            refused += 1
            continue
        megatron_order = order.replace("dp", "ep-dp")
        gen = RankGenerator(tp=tp, ep=ep, dp=dp * cp // ep, pp=pp, cp=1, order=megatron_order)
        for axes in GROUPS:
            assert expert_groups(layout, ep, axes) == gen.get_ranks(MEGATRON.get(axes, axes)), \
                (tp, cp, dp, pp, ep, order, axes)
        assert expert_groups(layout, ep, "pp") == layout.groups("pp")
        checked += 1
    assert checked > 100 and refused > 0


def test_at_ep_1_the_expert_data_groups_are_the_gradient_groups():
    for dp, cp in ((4, 1), (2, 2)):
        layout = Layout(dp=dp, cp=cp, tp=2, pp=2)
        assert expert_groups(layout, 1, "edp") == layout.groups(role_key("gradient"))


def test_dp4_ep2_spreads_experts_over_neighbouring_dp_ranks():
    layout = Layout(dp=4, tp=2)  # ranks 0..7, tp fastest
    assert expert_groups(layout, 2, "ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert expert_groups(layout, 2, "edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_an_order_that_keeps_cp_apart_from_dp_is_refused_for_ep():
    with pytest.raises(LayoutError, match="keeps cp apart from dp"):
        check_ep(Layout(dp=2, cp=2, pp=2, order="tp-cp-pp-dp"), 2)
    check_ep(Layout(dp=2, cp=2, pp=2, order="tp-pp-cp-dp"), 2)  # cp next to dp: fine


@pytest.mark.parametrize("ep, experts, needle", [
    (3, 0, "parallel.ep=3 does not divide dp*cp=4 (the ranks experts are spread over); choose "
           "ep in {1, 2, 4}"),
    (4, 6, "parallel.ep=4 does not divide model.moe.experts=6; choose ep in {1, 2}"),
    (0, 0, "parallel.ep=0 must be an integer >= 1"),
])
def test_a_bad_ep_is_one_line(ep, experts, needle):
    with pytest.raises(LayoutError) as err:
        check_ep(Layout(dp=4), ep, experts)
    assert str(err.value) == needle
