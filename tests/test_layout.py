"""Layout: pure rank arithmetic, checked against megatron-core's RankGenerator."""

import itertools

import pytest

from hybrid.planning.layout import Layout, LayoutError

ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "dp", "pp"))]
AXES = ["tp", "dp", "pp", "tp-pp", "tp-dp", "dp-pp", "tp-dp-pp"]


def _layouts_up_to(max_world):
    for dp, tp, pp in itertools.product(range(1, max_world + 1), repeat=3):
        if dp * tp * pp <= max_world:
            yield dp, tp, pp


@pytest.mark.slow
def test_groups_equal_megatron_rank_generator_for_every_layout_and_order():
    from megatron.core.parallel_state import RankGenerator

    checked = 0
    for dp, tp, pp in _layouts_up_to(32):  # each axis up to 32, all three > 1 from 8 ranks
        for order in ORDERS:
            layout = Layout(dp=dp, tp=tp, pp=pp, order=order)
            gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
            for axis in AXES:
                assert layout.groups(axis) == gen.get_ranks(axis), (dp, tp, pp, order, axis)
            checked += 1
    assert checked == 6 * sum(1 for _ in _layouts_up_to(32))


@pytest.mark.slow
def test_groups_with_cp_equal_megatron_rank_generator_for_every_order():
    """The fourth axis: every order of tp, cp, dp, pp and the groups of every axis set,
    megatron's dp-cp and tp-cp among them."""
    from megatron.core.parallel_state import RankGenerator

    axes = ["-".join(c) for n in (1, 2, 3, 4)
            for c in itertools.combinations(("tp", "cp", "dp", "pp"), n)]
    checked = 0
    for dp, tp, pp in _layouts_up_to(16):
        for cp in (2, 3):
            if dp * tp * pp * cp > 32:
                continue
            for order in ("-".join(p) for p in itertools.permutations(("tp", "cp", "dp", "pp"))):
                layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, order=order)
                gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
                for axis in axes:
                    assert layout.groups(axis) == gen.get_ranks(axis), (dp, cp, tp, pp, order,
                                                                         axis)
                checked += 1
    assert checked > 500


def test_cp_joins_the_gradient_loss_and_sharding_roles_and_has_its_own():
    layout = Layout(dp=2, cp=2, tp=2, pp=1)  # tp-cp-dp-pp: tp fastest, then cp
    assert layout.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for role in ("gradient", "loss", "sharding"):
        assert layout.role_groups(role) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.role_groups("data") == layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.role_groups("model") == layout.groups("tp")
    assert layout.role_rank("sharding", 6) == 3 and layout.role_rank("data", 6) == 1
    assert layout.coords(6) == {"dp": 1, "cp": 1, "tp": 0, "pp": 0}


def test_an_order_may_leave_out_cp_only_while_it_is_1():
    assert Layout(dp=2, tp=2, order="tp-pp-dp").axes == ("tp", "pp", "dp", "cp")
    with pytest.raises(LayoutError, match="cp > 1 must be placed.*order=tp-cp-dp-pp"):
        Layout(cp=2, order="tp-dp-pp")


@pytest.mark.parametrize("order", ORDERS)
def test_coords_and_rank_are_inverse(order):
    layout = Layout(dp=3, tp=2, pp=4, order=order)
    seen = set()
    for r in range(layout.world_size):
        c = layout.coords(r)
        assert layout.rank(**c) == r
        seen.add((c["dp"], c["tp"], c["pp"]))
    assert len(seen) == layout.world_size


def test_default_order_is_megatron_tp_fastest():
    layout = Layout(dp=2, tp=2, pp=2)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("embedding") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(5) == {"dp": 0, "cp": 0, "tp": 1, "pp": 1}


def test_each_axis_partitions_the_world():
    layout = Layout(dp=2, tp=3, pp=2, order="pp-tp-dp")
    for axis in AXES:
        flat = sorted(r for g in layout.groups(axis) for r in g)
        assert flat == list(range(layout.world_size))


def test_embedding_group_is_first_and_last_stage():
    assert Layout(pp=4, dp=2).embedding_groups() == [[0, 6], [1, 7]]
    assert Layout(dp=2).embedding_groups() == [[0], [1]]


def test_placement_reports_tp_crossing_nodes():
    good = Layout(dp=2, tp=4, pp=2)
    assert good.crossing_groups("tp", ranks_per_node=8) == []
    assert good.crossing_groups("pp", ranks_per_node=8) == [[0, 8], [1, 9], [2, 10], [3, 11],
                                                             [4, 12], [5, 13], [6, 14], [7, 15]]
    bad = Layout(dp=2, tp=4, pp=2, order="dp-tp-pp")
    assert bad.crossing_groups("tp", ranks_per_node=4)
    assert "tp group(s) cross nodes" in bad.placement_warnings(4)[0]
    assert [good.node_of(r, 8) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]


@pytest.mark.parametrize("kwargs, field", [
    ({"dp": 0}, "parallel.dp=0"),
    ({"tp": -1}, "parallel.tp=-1"),
    ({"pp": 1.5}, "parallel.pp=1.5"),
    ({"vpp": 0}, "parallel.vpp=0"),
    ({"order": "tp-dp"}, "parallel.order='tp-dp'"),
    ({"order": "tp-dp-xx"}, "parallel.order='tp-dp-xx'"),
])
def test_invalid_layouts_raise_one_line_naming_the_field(kwargs, field):
    with pytest.raises(LayoutError) as err:
        Layout(**kwargs)
    assert field in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_group_axis_and_rank():
    layout = Layout(dp=2)
    with pytest.raises(LayoutError, match="unknown group axis"):
        layout.groups("xp")
    with pytest.raises(LayoutError, match="rank=2 is outside"):
        layout.coords(2)
    with pytest.raises(LayoutError, match="tp=1 is outside"):
        layout.rank(tp=1)


def test_crosses_nodes_agrees_with_the_listed_crossing_groups():
    checked = 0
    for order in ("tp-dp-pp", "tp-pp-dp", "pp-dp-tp", "dp-tp-pp"):
        for dp, tp, pp in itertools.product((1, 2, 3, 4), (1, 2, 4), (1, 2, 3)):
            layout = Layout(dp=dp, tp=tp, pp=pp, order=order)
            for per_node in range(1, layout.world_size + 1):
                for axis in ("tp", "dp", "pp"):
                    listed = bool(layout.crossing_groups(axis, per_node))
                    assert layout.crosses_nodes(axis, per_node) == listed, \
                        (order, dp, tp, pp, per_node, axis)
                    checked += 1
    assert checked > 500
