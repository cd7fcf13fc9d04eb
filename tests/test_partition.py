"""Splitting blocks [embedding, layers..., head] into contiguous pipeline stages."""

import itertools
import random

import pytest

from hybrid.errors import UserError
from hybrid.planning.schedules.actions import rank_stages, stage_chunk, stage_rank
from hybrid.planning.schedules.partition import (
    PartitionError, format_partition, partition, stage_costs,
)


def _layers_per_stage(stages, n_special=(1, 1)):
    n_blocks = stages[-1].stop
    layer_blocks = set(range(n_special[0], n_blocks - n_special[1]))
    return [len(layer_blocks.intersection(stage)) for stage in stages]


@pytest.mark.parametrize("mode", ["uniform", "balanced", "measured"])
def test_stages_cover_every_block_once_in_order(mode):
    rng = random.Random(0)
    for n_layers, pp, vpp in itertools.product((1, 2, 5, 7, 12, 24), (1, 2, 3, 4, 8), (1, 2, 3)):
        if pp * vpp > n_layers:
            continue
        costs = [rng.randint(1, 100) for _ in range(n_layers + 2)]
        stages = partition(costs, pp, vpp, mode)
        assert len(stages) == pp * vpp
        assert [block for stage in stages for block in stage] == list(range(n_layers + 2))
        assert min(_layers_per_stage(stages)) >= 1, (n_layers, pp, vpp)
        assert 0 in stages[0] and n_layers + 1 in stages[-1]


def test_uniform_gives_extra_layers_to_the_earlier_stages():
    assert partition([0] * 9, 2) == [range(0, 5), range(5, 9)]  # 7 layers -> 4 + 3
    assert _layers_per_stage(partition([0] * 12, 4)) == [3, 3, 2, 2]  # 10 layers
    assert _layers_per_stage(partition([0] * 10, 2, 2)) == [2, 2, 2, 2]
    for n_layers in range(4, 30):
        counts = _layers_per_stage(partition([1] * (n_layers + 2), 4))
        assert max(counts) - min(counts) <= 1
        assert counts == sorted(counts, reverse=True)


def test_balanced_beats_or_ties_uniform_on_the_largest_stage():
    rng = random.Random(1)
    strictly_better = 0
    for _ in range(60):
        n_layers = rng.randint(4, 20)
        pp, vpp = rng.choice([(2, 1), (4, 1), (2, 2), (3, 1)])
        if pp * vpp > n_layers:
            continue
        costs = [rng.randint(0, 50) for _ in range(n_layers + 2)]
        balanced = max(stage_costs(partition(costs, pp, vpp, "balanced"), costs))
        uniform = max(stage_costs(partition(costs, pp, vpp, "uniform"), costs))
        assert balanced <= uniform
        strictly_better += balanced < uniform
    assert strictly_better > 10


def _brute_force_smallest_max(costs, n_stages):
    """Every way to cut the layers into n_stages non-empty groups (specials at the ends)."""
    n_layers = len(costs) - 2
    best = float("inf")
    for cuts in itertools.combinations(range(2, n_layers + 1), n_stages - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_balanced_finds_the_optimum_of_small_cases():
    rng = random.Random(2)
    for _ in range(40):
        n_layers, n_stages = rng.randint(2, 9), rng.randint(1, 4)
        if n_stages > n_layers:
            continue
        costs = [rng.randint(0, 30) for _ in range(n_layers + 2)]
        stages = partition(costs, n_stages, 1, "balanced")
        assert max(stage_costs(stages, costs)) == _brute_force_smallest_max(costs, n_stages)


def test_measured_split_never_drops_or_duplicates_a_block():
    """Measured seconds: floats, zeros, a head up to 60 layers heavy; any stage count."""
    rng = random.Random(3)
    for _ in range(400):
        n_layers = rng.randint(1, 30)
        pp, vpp = rng.randint(1, 8), rng.randint(1, 3)
        if pp * vpp > n_layers:
            continue
        layer = rng.lognormvariate(-5, 1)
        costs = ([rng.choice([0.0, layer * rng.random()])]
                 + [layer * rng.uniform(0.8, 1.2) for _ in range(n_layers)]
                 + [layer * rng.uniform(0, 60)])
        stages = partition(costs, pp, vpp, "measured")
        assert len(stages) == pp * vpp
        assert [block for stage in stages for block in stage] == list(range(n_layers + 2))
        assert min(_layers_per_stage(stages)) >= 1
        largest = max(stage_costs(stages, costs))
        assert largest <= max(stage_costs(partition(costs, pp, vpp), costs)) * (1 + 1e-12)
        assert largest == pytest.approx(max(stage_costs(partition(costs, pp, vpp, "balanced"),
                                                        costs)))


def test_measured_finds_the_optimum_of_small_float_cases():
    rng = random.Random(4)
    for _ in range(40):
        n_layers, n_stages = rng.randint(2, 8), rng.randint(1, 4)
        if n_stages > n_layers:
            continue
        costs = [rng.uniform(0, 0.05) for _ in range(n_layers + 2)]
        largest = max(stage_costs(partition(costs, n_stages, 1, "measured"), costs))
        assert largest == pytest.approx(_brute_force_smallest_max(costs, n_stages), rel=1e-9)


def test_balanced_moves_layers_away_from_a_heavy_head():
    costs = [10] + [10] * 8 + [50]  # the head weighs five layers
    assert _layers_per_stage(partition(costs, 2, mode="uniform")) == [4, 4]
    assert _layers_per_stage(partition(costs, 2, mode="balanced")) == [6, 2]
    assert stage_costs(partition(costs, 2, mode="balanced"), costs) == [70, 70]


def test_balanced_evens_out_the_stages_below_the_maximum():
    costs = [50] + [10] * 7 + [60]
    assert stage_costs(partition(costs, 2, 2, "balanced"), costs) == [60, 20, 30, 70]


def test_other_special_block_counts():
    stages = partition([1] * 6, 2, n_special=(0, 0))  # six layers, no embedding or head
    assert stages == [range(0, 3), range(3, 6)]
    stages = partition([1] * 8, 2, n_special=(2, 1))  # 5 layers
    assert stages == [range(0, 5), range(5, 8)]
    assert _layers_per_stage(stages, (2, 1)) == [3, 2]


@pytest.mark.parametrize("kwargs,match", [
    (dict(costs=[1] * 8, pp=4, vpp=2),
     r"pp\*vpp = 4\*2 = 8 stages need at least 8 transformer layers, the model has 6; "
     r"lower pp or vpp"),
    (dict(costs=[1] * 8, pp=2, mode="greedy"), "unknown partition mode 'greedy'"),
    (dict(costs=[1, -1, 1, 1], pp=1), "costs must be >= 0"),
    (dict(costs=[1] * 8, pp=0), "pp=0 must be an integer >= 1"),
    (dict(costs=[1] * 8, pp=2, n_special=(-1, 1)), "must count blocks"),
])
def test_errors_are_one_actionable_line(kwargs, match):
    with pytest.raises(PartitionError, match=match) as caught:
        partition(**kwargs)
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, UserError)  # one line for the person, never a bug


def test_placement_is_megatron_interleaved_and_rank_stages_inverts_it():
    assert [(stage_rank(s, 4), stage_chunk(s, 4)) for s in range(8)] == [
        (0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)]
    assert (stage_rank(5, 1), stage_chunk(5, 1)) == (0, 5)
    for pp, vpp in ((1, 1), (2, 1), (4, 2), (3, 3)):
        held = [rank_stages(r, pp, vpp) for r in range(pp)]
        assert sorted(s for stages in held for s in stages) == list(range(pp * vpp))
        assert all([stage_chunk(s, pp) for s in stages] == list(range(vpp))
                   and {stage_rank(s, pp) for s in stages} == {r}
                   for r, stages in enumerate(held))


def test_format_partition_lines():
    costs = [1] * 10  # 8 layers
    text = format_partition(partition(costs, 2, 2), 2, 8, costs=costs)
    assert text.splitlines() == [
        "rank 0 chunk 0 (stage 0): blocks 0-2 [embedding, layer 0..1] cost 3",
        "rank 0 chunk 1 (stage 2): blocks 5-6 [layer 4..5] cost 2",
        "rank 1 chunk 0 (stage 1): blocks 3-4 [layer 2..3] cost 2",
        "rank 1 chunk 1 (stage 3): blocks 7-9 [layer 6..7, head] cost 3",
    ]
    assert format_partition(partition([1] * 9, 2), 2).splitlines()[0] == (
        "rank 0 chunk 0 (stage 0): blocks 0-4 [embedding, layer 0..3]")
    assert format_partition(partition([1] * 4, 2), 2).splitlines() == [
        "rank 0 chunk 0 (stage 0): blocks 0-1 [embedding, layer 0]",
        "rank 1 chunk 0 (stage 1): blocks 2-3 [layer 1, head]",
    ]
    with pytest.raises(PartitionError, match="cover 4 blocks, not 3 layers"):
        format_partition(partition([1] * 4, 2), 2, 3)


def test_a_job_plans_stages_where_the_placement_function_puts_them():
    from hybrid.planning.config import Config
    from hybrid.planning.job import plan_job

    cfg = Config()
    cfg.model.layers, cfg.parallel.pp, cfg.parallel.vpp = 8, 4, 2
    cfg.parallel.schedule, cfg.train.global_batch = "interleaved-1f1b", 32
    plan = plan_job(cfg)
    for rank in range(4):
        assert [st.index for st in plan.stages_of(rank)] == rank_stages(rank, 4, 2)
        assert all(st.pp_rank == stage_rank(st.index, 4) for st in plan.stages_of(rank))
