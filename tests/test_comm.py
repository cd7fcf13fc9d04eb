"""hybrid's groups (``hybrid.comm.Group``): every operation counted per label with its ring
bytes, waits timed and described, nothing of torch patched, and nothing bypassing them."""

import pytest
import torch
import torch.distributed as dist

from hybrid.comm import RECV, SEND, CommCounter, Message, wire_bytes
from hybrid.groups import ParallelGroups
from hybrid.planning.layout import Layout
from hybrid.testing import c10d_ops_mode, spawn

pytestmark = pytest.mark.timeout(180)

FLOAT = 4


def test_wire_bytes_are_ring_volumes():
    assert wire_bytes("all_reduce", 400, 4) == 600  # 2(d-1)/d n
    assert wire_bytes("gather_scatter", 400, 4) == 300  # (d-1)/d n
    assert wire_bytes("send", 400, 2) == 400
    assert wire_bytes("recv", 400, 2) == 0
    assert wire_bytes("all_reduce", 400, 1) == 0  # a 1-rank group moves nothing


def _torch_untouched() -> dict:
    return {**vars(dist.ProcessGroup), **{k: v for k, v in vars(dist).items() if callable(v)},
            "Work.wait": dist.Work.__dict__["wait"]}


def _collectives(rank, world):
    groups = ParallelGroups.create(Layout(dp=2, tp=2))
    counter = CommCounter(groups)
    before = _torch_untouched()
    with counter.track():
        groups.gradient.all_reduce(torch.ones(100), async_op=True).wait()
        groups.tensor.reduce_scatter_into(torch.empty(50), torch.ones(100))
        groups.tensor.all_gather_into(torch.empty(100), torch.ones(50))
        groups.tensor.all_gather([torch.empty(50), torch.empty(50)], torch.ones(50))
        groups.model.all_reduce(torch.ones(10))  # tp-pp: reported as "other"
        groups.world.all_reduce(torch.ones(10))
    after = _torch_untouched()
    untouched = after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    untracked = counter.snapshot()
    groups.gradient.all_reduce(torch.ones(10))  # outside track(): not counted
    assert counter.snapshot() == untracked
    return counter.snapshot(), untouched


def _point_to_point(rank, world):
    groups = ParallelGroups.create(Layout(tp=2, pp=2))
    counter = CommCounter(groups)
    peer = groups.pp_neighbour(1)
    tensor = torch.full((10,), float(rank))
    with counter.track():
        kind = SEND if groups.is_first_stage else RECV
        for work in groups.pipeline.exchange([Message(kind, tensor, peer, tag=7)] * 2):
            work.wait()
        with pytest.raises(RuntimeError, match="already tracking"):
            with counter.track():
                pass
    return counter.snapshot(), groups.is_first_stage, tensor[0].item(), peer


def test_collectives_are_attributed_to_their_label_with_ring_bytes():
    for counts, untouched in spawn(_collectives, 4):
        assert untouched
        assert counts["dp"] == {"calls": 1, "bytes": 100 * FLOAT, "payload": 100 * FLOAT}
        # reduce-scatter (input 100), all-gather (output 100), all-gather into a list
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

    from hybrid.diagnosis.watch import RankWatch

    groups = ParallelGroups.create(Layout(dp=2), timeout=timedelta(seconds=2))
    watch = RankWatch(rank)
    watch.start_step(3)
    before = _torch_untouched()
    failed = None
    with CommCounter(groups, watch=watch).track():
        groups.gradient.all_reduce(torch.ones(10))
        watch.wait_async(groups.gradient.all_reduce(torch.ones(10), async_op=True))
        if rank == 0:  # rank 1 never joins the third: rank 0's wait times out
            try:
                groups.gradient.all_reduce(torch.ones(10))
            except RuntimeError:
                failed = watch.failed_wait()
    after = _torch_untouched()
    untouched = all(after[k] is before[k] for k in before)
    groups.world.barrier()
    return failed, watch.wait_s, untouched, watch.waiting if rank else None


def test_the_watch_times_waits_per_axis_and_keeps_the_failed_one():
    """Synchronous collectives are waited (timed) where they are issued, asynchronous ones in
    ``wait_async``; a failed wait says which collective it was (the third on the DP group
    this step). Nothing of torch is replaced, Work.wait included."""
    (failed, waits0, untouched0, _), (none, waits1, untouched1, waiting) = spawn(_watched, 2)
    assert untouched0 and untouched1 and none is None and waiting is None
    assert failed["axis"] == "dp" and failed["op"] == "all_reduce" and failed["seq"] == 3
    assert failed["ranks"] == [0, 1] and failed["peer"] is None
    assert 1.5 < failed["waited_s"] < 10 and waits0["dp"] > 0
    assert waits1["dp"] > 0 and waits1["tp"] == waits1["pp"] == 0


def _steps_seen_by_torch(rank, world, plan_dict, run_dir):
    from pathlib import Path

    from hybrid.planning.plan_file import plan_from_dict
    from hybrid.train import Trainer

    plan = plan_from_dict(plan_dict)
    trainer = Trainer(plan, ParallelGroups.create(plan.layout), Path(run_dir))
    seen, counted = [], []
    for step in (1, 2):
        with c10d_ops_mode() as mode:
            report = trainer.step(step)
        seen.append(sorted(set(mode.ops)))
        counted.append((len(mode.ops), sum(c["calls"] for c in report.comm.values())))
    return seen, counted


@pytest.mark.slow
def test_every_operation_of_a_training_step_goes_through_hybrids_groups(tmp_path):
    """Two steps of a 2x2x2 job with every kind of traffic (TP with sequence parallelism, a
    tied embedding across the pipeline, ZeRO-1, clipping): torch's own dispatcher sees exactly
    as many c10d operations on each rank as hybrid's groups counted."""
    from hybrid.planning.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from hybrid.planning.job import plan_job
    from hybrid.planning.plan_file import plan_to_dict

    cfg = Config(model=ModelConfig(tie_embeddings=True),
                 parallel=ParallelConfig(dp=2, tp=2, pp=2, zero=1, sequence_parallel=True),
                 train=TrainConfig(steps=2, global_batch=8, micro_batch=2, timeline_step=0))
    plan = plan_to_dict(plan_job(cfg))  # planned once, here: the ranks read it
    results = spawn(_steps_seen_by_torch, 8, plan, str(tmp_path), timeout=240)
    kinds = set()
    for seen, counted in results:
        kinds |= {op for step in seen for op in step}
        for ops, calls in counted:
            assert ops == calls > 0
    assert {"allreduce_.default", "send.default", "recv_.default",
            "_reduce_scatter_base_.default", "_allgather_base_.default"} <= kinds
