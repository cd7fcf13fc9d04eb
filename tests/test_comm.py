"""CommCounter: per-axis calls and bytes of collectives, including megatron's internal ones."""

import pytest
import torch
import torch.distributed as dist

from hybrid.comm import CommCounter, wire_bytes
from hybrid.groups import ParallelGroups
from hybrid.planning.layout import Layout
from hybrid.testing import spawn

pytestmark = pytest.mark.timeout(180)

FLOAT = 4


def test_wire_bytes_are_ring_volumes():
    assert wire_bytes("all_reduce", 400, 4) == 600  # 2(d-1)/d n
    assert wire_bytes("scatter_gather", 400, 4) == 300  # (d-1)/d n
    assert wire_bytes("send", 400, 2) == 400
    assert wire_bytes("recv", 400, 2) == 0
    assert wire_bytes("all_reduce", 400, 1) == 0  # a 1-rank group moves nothing


def _collectives(rank, world):
    from megatron.core.tensor_parallel import mappings  # holds import-time aliases of torch's

    groups = ParallelGroups.create(Layout(dp=2, tp=2))
    counter = CommCounter(groups)
    before = dict(vars(dist.ProcessGroup))
    with counter.track():
        dist.all_reduce(torch.ones(100), group=groups.dp, async_op=True).wait()
        dist.reduce_scatter_tensor(torch.empty(50), torch.ones(100), group=groups.tp)
        dist.all_gather_into_tensor(torch.empty(100), torch.ones(50), group=groups.tp)
        mappings.dist_all_gather_func(torch.empty(100), torch.ones(50), group=groups.tp)
        dist.all_reduce(torch.ones(10), group=groups.mp)  # tp-pp: reported as "other"
        dist.all_reduce(torch.ones(10))  # the world group
    after = dict(vars(dist.ProcessGroup))
    restored = after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    untracked = counter.snapshot()
    dist.all_reduce(torch.ones(10), group=groups.dp)  # outside track(): not counted
    assert counter.snapshot() == untracked
    return counter.snapshot(), restored


def _point_to_point(rank, world):
    groups = ParallelGroups.create(Layout(tp=2, pp=2))
    counter = CommCounter(groups)
    peer = groups.pp_neighbour(1)
    tensor = torch.full((10,), float(rank))
    with counter.track():
        op = dist.isend if groups.is_first_stage else dist.irecv
        for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group=groups.pp)]):
            work.wait()
        if groups.is_first_stage:  # the default group, attributed by the peer's rank
            dist.send(tensor, peer)
        else:
            dist.recv(tensor, peer)
        with pytest.raises(RuntimeError, match="already tracking"):
            with CommCounter(groups).track():
                pass
    return counter.snapshot(), groups.is_first_stage, tensor[0].item(), peer


def test_collectives_are_attributed_to_their_axis_with_ring_bytes():
    for counts, restored in spawn(_collectives, 4):
        assert restored
        assert counts["dp"] == {"calls": 1, "bytes": 100 * FLOAT, "payload": 100 * FLOAT}
        # reduce-scatter (input 100), all-gather (output 100), megatron's alias of all-gather
        assert counts["tp"] == {"calls": 3, "bytes": 3 * 50 * FLOAT, "payload": 3 * 100 * FLOAT}
        assert counts["pp"]["calls"] == 0
        assert counts["other"]["calls"] == 2


def test_point_to_point_counts_sends_on_the_wire_and_is_attributed_to_pp():
    for counts, first, received, peer in spawn(_point_to_point, 4):
        assert counts["pp"]["calls"] == 2
        assert counts["pp"]["payload"] == 2 * 10 * FLOAT
        assert counts["pp"]["bytes"] == (2 * 10 * FLOAT if first else 0)
        assert counts["other"]["calls"] == counts["dp"]["calls"] == 0
        if not first:
            assert received == peer  # the data really arrived from the previous stage


def _watched(rank, world):
    from datetime import timedelta

    from hybrid.watch import RankWatch

    groups = ParallelGroups.create(Layout(dp=2), timeout=timedelta(seconds=2))
    watch = RankWatch(rank)
    watch.start_step(3)
    before = dist.Work.__dict__["wait"]
    failed = None
    with CommCounter(groups, watch=watch).track():
        dist.all_reduce(torch.ones(10), group=groups.dp)
        watch.wait_async(dist.all_reduce(torch.ones(10), group=groups.dp, async_op=True))
        if rank == 0:  # rank 1 never joins the third: rank 0's wait times out
            try:
                dist.all_reduce(torch.ones(10), group=groups.dp)
            except RuntimeError:
                failed = watch.failed_wait()
    untouched = dist.Work.__dict__["wait"] is before
    dist.barrier()
    return failed, watch.wait_s, untouched, watch.waiting if rank else None


def test_the_watch_times_waits_per_axis_and_keeps_the_failed_one():
    """Synchronous collectives are waited (timed) where they are issued, asynchronous ones in
    ``wait_async``; a failed wait says which collective it was (the third on the DP group
    this step). Work.wait itself is never patched (a wrapper costs 0.25 ms per wait)."""
    (failed, waits0, untouched0, _), (none, waits1, untouched1, waiting) = spawn(_watched, 2)
    assert untouched0 and untouched1 and none is None and waiting is None
    assert failed["axis"] == "dp" and failed["op"] == "all_reduce" and failed["seq"] == 3
    assert failed["ranks"] == [0, 1] and failed["peer"] is None
    assert 1.5 < failed["waited_s"] < 10 and waits0["dp"] > 0
    assert waits1["dp"] > 0 and waits1["tp"] == waits1["pp"] == 0
