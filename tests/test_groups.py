"""ParallelGroups on real gloo processes, and the spawn harness itself."""

import threading

import pytest
import torch
import torch.distributed as dist

from hybrid.groups import ParallelGroups
from hybrid.planning.layout import EMBEDDING, ROLES, Layout, role_key
from hybrid.testing import SpawnError, spawn

pytestmark = pytest.mark.timeout(180)


def _all_reduce_members(rank, world, layout_kwargs):
    layout = Layout(**layout_kwargs)
    groups = ParallelGroups.create(layout)
    seen, ranks = {}, {}
    for role in (*ROLES, EMBEDDING):
        # Each rank contributes a one-hot of its own rank: the sum says who took part.
        onehot = torch.zeros(world)
        onehot[rank] = 1.0
        group = groups.role(role) if role != EMBEDDING else groups.embedding
        group.all_reduce(onehot)
        seen[role] = [int(i) for i in torch.nonzero(onehot).flatten()]
        ranks[role] = (group.ranks, group.rank(), group.label)
    return seen, groups.coords, ranks


@pytest.mark.parametrize("layout_kwargs", [
    {"dp": 2, "tp": 2, "pp": 2},
    {"dp": 2, "tp": 2, "pp": 2, "order": "pp-dp-tp"},
])
def test_all_reduce_in_each_role_sums_exactly_the_layout_group(layout_kwargs):
    layout = Layout(**layout_kwargs)
    results = spawn(_all_reduce_members, 8, layout_kwargs)
    for rank, (seen, coords, ranks) in enumerate(results):
        assert coords == layout.coords(rank)
        for role, members in seen.items():
            expected = layout.group_of(role_key(role), rank)
            assert members == sorted(expected), (rank, role)
            assert ranks[role] == (expected, expected.index(rank), role_key(role))
        # a single-axis role's group rank is the rank's coordinate on that axis
        assert ranks["pipeline"][1] == coords["pp"] and ranks["tensor"][1] == coords["tp"]
        assert ranks["data"][1] == coords["dp"]


def _two_layouts_in_one_process(rank, world):
    parallel = ParallelGroups.create(Layout(tp=2, dp=world // 2))
    reference = ParallelGroups.create(Layout())  # a 1-rank replica on every process
    x = torch.ones(1)
    parallel.tensor.all_reduce(x)
    y = torch.ones(1)
    reference.tensor.all_reduce(y)
    return x.item(), y.item(), reference.coords, reference.replica_offset


def test_two_layouts_coexist_and_small_layouts_replicate():
    results = spawn(_two_layouts_in_one_process, 4)
    for rank, (tp_sum, ref_sum, ref_coords, offset) in enumerate(results):
        assert (tp_sum, ref_sum) == (2.0, 1.0)
        assert ref_coords == {"dp": 0, "cp": 0, "tp": 0, "pp": 0}
        assert offset == rank


def _layout_not_fitting_world(rank, world):
    ParallelGroups.create(Layout(tp=3))


def test_layout_that_does_not_divide_the_world_is_a_layout_error():
    with pytest.raises(SpawnError, match="world size 2 is not a multiple of dp\\*cp\\*tp\\*pp=3"):
        spawn(_layout_not_fitting_world, 2)


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever without the harness


def test_harness_reports_failing_rank_and_does_not_hang():
    with pytest.raises(SpawnError, match="rank 1 of 2 failed") as err:
        spawn(_fail_on_rank_one, 2, timeout=60)
    assert "boom on purpose" in str(err.value)


def _a_tensor(rank, world):
    return torch.arange(4.0)


def test_harness_reads_a_result_after_its_rank_has_exited(tmp_path):
    """A rank may exit the moment it has put its result; the result must not depend on it."""
    from hybrid.testing import _collect, _context, _kill, _worker

    results = _context().Queue()
    proc = _context().Process(target=_worker, daemon=True,
                              args=(0, 1, str(tmp_path / "store"), _a_tensor, (), results, 30))
    proc.start()
    try:
        proc.join(timeout=60)
        assert proc.exitcode == 0
        out, = _collect([proc], results, 1, timeout=30)
    finally:
        _kill([proc])
    assert torch.equal(out, torch.arange(4.0))


def _hang(rank, world):
    if rank == 1:
        threading.Event().wait()  # blocks forever outside any collective: only a timeout ends it


@pytest.mark.slow
def test_harness_times_out_a_hung_job():
    with pytest.raises(SpawnError, match="timed out after 5s waiting for ranks \\[1\\]"):
        spawn(_hang, 2, timeout=5)
