"""``parallel.pp_balance_move=memory`` (issue 55), its pure part: who sends which layer's state
to whom when the pipeline is re-split (``hybrid.planning.stage_move``), checked on dp2 x tp2
layouts without processes, and the settings' rules. The move itself, through
``hybrid-train``, is in ``tests/test_pp_balance_e2e.py``."""

from collections import Counter

import pytest

from hybrid.planning.job import plan_job
from hybrid.planning.layout import Layout, LayoutError
from hybrid.planning.models.moe import expert_bias_name
from hybrid.planning.param_spec import EMBEDDING_WEIGHT
from hybrid.planning.stage_balance import layer_counts, split_of_counts
from hybrid.planning.stage_move import (block_state_names, kept_names, rank_transfers,
                                        stage_state_names, stage_transfers)
from launch.commands.app import compose_train_config


def names_of(layers, *overrides, model="tiny"):
    cfg = compose_train_config([f"model={model}", "parallel=single", f"model.layers={layers}",
                                *overrides])
    return [block_state_names(cfg.model, b) for b in range(layers + 2)]


def check_plan(layout, names, old, new):
    """Every rank gets each name it needs and did not hold from exactly one rank that held
    it, on its own pipeline (same dp, cp, tp); nothing goes to a rank that keeps it; every
    send is the receive of its peer, in the same order on both ends. Returns the transfers."""
    transfers = stage_transfers(layout, names, old, new)
    held, needed = stage_state_names(names, old), stage_state_names(names, new)
    sources = Counter((t.name, t.dst) for t in transfers)
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        stage = coords["pp"]
        got = {name for name, dst in sources if dst == rank}
        assert got == needed[stage] - held[stage], (rank, got ^ (needed[stage] - held[stage]))
        assert not got & kept_names(names, old, new, stage)
        sends, recvs = rank_transfers(transfers, rank)
        for t in sends:  # the receiver lists the same transfers with this rank, in order
            peer_recvs = rank_transfers(transfers, t.dst)[1]
            assert [r for r in peer_recvs if r.src == rank] == [s for s in sends
                                                               if s.dst == t.dst]
        for t in recvs:
            source = layout.coords(t.src)
            assert t.name in held[source["pp"]]
            assert {**source, "pp": stage} == coords  # the same TP shard, the same DP rank
    assert all(n == 1 for n in sources.values()), sources.most_common(1)
    return transfers


@pytest.mark.parametrize("old, new", [([4, 4], [6, 2]), ([4, 4], [2, 6])])
def test_pp2_moves_send_each_moved_layer_once_to_each_rank_of_its_new_stage(old, new):
    layout = Layout(dp=2, tp=2, pp=2)
    names = names_of(8)
    transfers = check_plan(layout, names, split_of_counts(old), split_of_counts(new))
    moved = {t.name.split(".")[1] for t in transfers}
    assert moved == ({"5", "6"} if new == [6, 2] else {"3", "4"})
    # 2 layers x 12 tensors, to each of the 4 ranks (dp2 x tp2) of the receiving stage
    assert len(transfers) == 2 * 12 * 4
    assert all(layout.coords(t.src)["pp"] != layout.coords(t.dst)["pp"] for t in transfers)


def test_pp4_moves_go_both_ways_and_past_a_neighbour():
    layout = Layout(dp=2, tp=2, pp=4)
    names = names_of(8)
    even = split_of_counts([2, 2, 2, 2])
    transfers = check_plan(layout, names, even, split_of_counts([1, 3, 3, 1]))
    by_pair = Counter((layout.coords(t.src)["pp"], layout.coords(t.dst)["pp"])
                      for t in transfers)
    assert by_pair == {(0, 1): 12 * 4, (3, 2): 12 * 4}  # layer 2 down, layer 7 up
    far = check_plan(layout, names, split_of_counts([1, 1, 1, 5]),
                     split_of_counts([5, 1, 1, 1]))
    assert {(layout.coords(t.src)["pp"], layout.coords(t.dst)["pp"]) for t in far} == {
        (1, 0), (2, 0), (3, 0), (3, 1), (3, 2)}
    assert not check_plan(layout, names, even, even)


def test_a_split_in_layers_per_stage_is_block_ranges():
    assert split_of_counts([4, 4]) == [range(0, 5), range(5, 10)]
    assert split_of_counts([1, 3, 3, 1]) == [range(0, 2), range(2, 5), range(5, 8),
                                             range(8, 10)]
    assert layer_counts(split_of_counts([7, 1])) == [7, 1]


def test_a_name_two_stages_hold_comes_from_the_lowest():
    layout = Layout(tp=2, pp=3)
    blocks = [frozenset({EMBEDDING_WEIGHT}), frozenset({"a"}), frozenset({"b"}),
              frozenset({"c", EMBEDDING_WEIGHT})]  # a tied head holds the embedding too
    shared = frozenset({"shared"})  # a name two stages hold before the move
    blocks = [blocks[0], blocks[1] | shared, blocks[2] | shared, blocks[3]]
    old = [range(0, 1), range(1, 3), range(3, 4)]
    new = [range(0, 2), range(2, 3), range(3, 4)]
    transfers = check_plan(layout, blocks, old, new)
    assert {(t.name, layout.coords(t.src)["pp"], layout.coords(t.dst)["pp"])
            for t in transfers} == {("a", 1, 0), ("shared", 1, 0)}


def test_an_expert_bias_moves_with_its_layer():
    names = names_of(4, "model.moe.expert_bias_rate=0.001", model="moe-tiny")
    moe_layers = [b for b in range(1, 5) if expert_bias_name(b) in names[b]]
    assert moe_layers, "moe-tiny has MoE layers"
    assert not any(expert_bias_name(b) in block_state_names(
        compose_train_config(["model=moe-tiny", "parallel=single"]).model, b)
        for b in range(1, 3))  # no bias when the rate is 0


def test_the_move_setting_is_checked_in_one_line():
    cfg = compose_train_config(["model=tiny", "parallel=single", "parallel.pp=2",
                                "parallel.pp_balance=dynamic", "parallel.pp_balance_move=disk"])
    with pytest.raises(LayoutError, match=r"^parallel.pp_balance_move='disk' is unknown; "
                                          r"choose one of memory, checkpoint$"):
        plan_job(cfg)
    delayed = compose_train_config(["model=tiny", "parallel=single", "parallel.pp=2",
                                    "parallel.dp=2", "parallel/dp=delayed",
                                    "parallel.pp_balance=dynamic"])
    with pytest.raises(LayoutError, match=r"^parallel.pp_balance=dynamic cannot move the "
                                          r"delayed DP reduction's state .*dp_delay=1"):
        plan_job(delayed)
    plan_job(compose_train_config(["model=tiny", "parallel=single", "parallel.pp=2",
                                   "parallel.dp=2", "parallel/dp=delayed"]))  # static: fine
