"""A new pipeline schedule, action kind and DP strategy, registered from this file alone, train
through the trainer on 2 ranks: no core module knows them (docs/architecture.md, "where a change
goes").

- ``reverse-gpipe``: GPipe with the backwards in reverse micro-batch order (the last forward's
  backward first, as torch's first GPipe did); one ``ScheduleSpec``. Its lists carry an
  action of a kind registered here, ``MARK`` (after each backward), that the checker, the
  simulator, the plan file and the runtime take as any list's step: the runtime calls its
  ``run`` on the rank, in list order.
- ``fp16``: the exact reduction's collectives on fp16 copies of the gradients; one
  ``ReductionSpec`` and its runtime class, selected by ``parallel.dp_compress=fp16``.

Each is validated, planned, priced and run like a built-in one: the plan accepts the names,
the runs match the 1-process run, and the DP bytes the run counts are the spec's prediction.
"""

import json
from pathlib import Path

import pytest
import torch

from hybrid.dp.reduce import ExactMean
from hybrid.planning.config import Config, ModelConfig, ParallelConfig, TrainConfig, to_dict
from hybrid.planning.job import plan_job
from hybrid.planning.plan_file import plan_from_dict, plan_to_dict, save_plan
from hybrid.planning.schedules import SCHEDULES, ScheduleSpec, register_schedule
from hybrid.planning.schedules import add_communication, build_schedule
from hybrid.planning.schedules.actions import (
    BACKWARD, EXTRA_KINDS, FORWARD, Action, ScheduleError, from_text, register_action_kind,
    to_text,
)
from hybrid.planning.schedules.check import check_schedule
from hybrid.planning.schedules.simulate import simulate
from hybrid.planning.strategies import REDUCTIONS, ReductionSpec, register_reduction
from hybrid.testing.accounting import checked_records
from hybrid.testing import spawn

pytestmark = pytest.mark.timeout(300)
FP16 = 2


MARKED: list[tuple[int, int]] = []
"""(stage, micro-batch) of every ``MARK`` this process ran."""


def _reverse_gpipe(pp: int, m: int, vpp: int) -> list[list[Action]]:
    return [[Action(r, FORWARD, mb) for mb in range(m)]
            + [a for mb in reversed(range(m)) for a in (Action(r, BACKWARD, mb),
                                                        Action(r, "MARK", mb))]
            for r in range(pp)]


REVERSE_GPIPE = ScheduleSpec(
    name="reverse-gpipe", build=_reverse_gpipe,
    closed_form=lambda pp, m, vpp: ((pp - 1) / (m + pp - 1), tuple([m] * pp)),
    warmup_step=lambda forward, backward, vpp: forward + backward,
    last_stage_holds=lambda m: m, doc="GPipe, backwards last-in first-out")


class Fp16Mean(ExactMean):
    """The mean of fp16 copies, accumulated back into the fp32 gradients."""

    def launch(self, bucket, shard):
        low = bucket.grad.mul(1.0 / bucket.group.size()).to(torch.float16)
        bucket.works.append(bucket.group.all_reduce(low, async_op=True))
        bucket.on_done.append(lambda: bucket.grad.copy_(low))


class Fp16(ReductionSpec):
    name, runtime, grad_width, shardings = "fp16", Fp16Mean, FP16, (0,)
    doc = "the exact collectives on fp16 copies"

    def setting(self, options):
        return "dp_compress=fp16" if options.compress == self.name else None


def register() -> None:
    """Idempotent: the test process and every spawned rank (which imports this module to find
    its function) register the same specs."""
    register_action_kind("MARK", after=BACKWARD, run=lambda stage, mb: MARKED.append((stage, mb)),
                         doc="a micro-batch's backward is done")
    register_schedule(REVERSE_GPIPE)
    register_reduction(Fp16())


@pytest.fixture(scope="module", autouse=True)
def registered():
    register()
    yield
    SCHEDULES.pop(REVERSE_GPIPE.name)
    REDUCTIONS.pop("fp16")
    EXTRA_KINDS.pop("MARK")


def _config(**parallel) -> Config:
    return Config(model=ModelConfig(layers=2, vocab_pad_multiple=64),
                  parallel=ParallelConfig(**parallel),
                  train=TrainConfig(steps=4, global_batch=8, micro_batch=2, timeline_step=0,
                                    log_every=100))


def _train(rank, world, plan_dict, run_dir):
    from hybrid.groups import ParallelGroups
    from hybrid.train import Trainer

    register()
    plan = plan_from_dict(plan_dict)
    losses = Trainer(plan, ParallelGroups.create(plan.layout), Path(run_dir)).run()["losses"]
    return losses, list(MARKED)


def _run(cfg: Config, run_dir: Path, marked: list | None = None) -> list[float]:
    """The losses of ``cfg``'s run (``marked``: extended by every rank's ``MARK`` runs)."""
    plan = plan_job(cfg)  # validation and planning accept the registered names
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg)))
    save_plan(plan, run_dir)
    ranks = spawn(_train, plan.world_size, plan_to_dict(plan), str(run_dir), timeout=240)
    losses = ranks[0][0]
    assert [r["loss"] for r in checked_records(run_dir)] == losses  # bytes as predicted
    if marked is not None:
        marked.extend(mark for _, marks in ranks for mark in marks)
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    return _run(_config(), tmp_path_factory.mktemp("single") / "run")


def test_a_schedule_registered_here_trains_like_the_one_process_model(reference, tmp_path):
    marked: list = []
    losses = _run(_config(pp=2, schedule="reverse-gpipe"), tmp_path / "run", marked)
    assert losses == pytest.approx(reference, rel=1e-5)
    # every rank ran its MARKs in its list's order: 4 steps of 4 micro-batches, last first
    assert marked == [(stage, mb) for stage in (0, 1) for _ in range(4) for mb in (3, 2, 1, 0)]


def test_an_action_kind_registered_here_is_read_checked_lowered_and_timed():
    """``MARK`` (registered above, after its backward): text round trip, the checker's
    refusals in one line, a lowering and a simulation that pass over it (no data, no time)."""
    lists = build_schedule("reverse-gpipe", pp=2, m=3)
    assert "1MARK2" in to_text(lists) and from_text(to_text(lists)) == lists
    check_schedule(add_communication(lists, pp=2), pp=2, m=3)
    bare = [[a for a in actions if a.kind != "MARK"] for actions in lists]
    assert simulate(lists, 2, 3).makespan == simulate(bare, 2, 3).makespan
    early = [actions[:] for actions in lists]
    early[0].insert(0, early[0].pop(early[0].index(Action(0, "MARK", 0))))
    with pytest.raises(ScheduleError, match=r"rank 0: 0MARK0 runs before 0B0; move it after"):
        check_schedule(early, pp=2, m=3)
    with pytest.raises(ScheduleError, match="register it"):
        Action(0, "NOPE", 0)
    with pytest.raises(ScheduleError, match="not a built-in kind"):
        register_action_kind("SEND_F")


def test_a_dp_strategy_registered_here_trains_and_sends_what_it_predicts(reference, tmp_path):
    plan = plan_job(_config(dp=2, dp_compress="fp16"))
    assert plan.dp_strategies == ("replicated", "fp16")
    losses = _run(_config(dp=2, dp_compress="fp16"), tmp_path / "run")
    assert losses == pytest.approx(reference, rel=2e-3)  # fp16 rounding of each share
    assert losses != reference  # it really reduced fp16 copies


def test_both_are_refused_where_their_specs_say():
    from hybrid.planning.layout import LayoutError

    cfg = _config(pp=2, vpp=2, schedule="reverse-gpipe")
    cfg.model.layers = 4
    with pytest.raises(LayoutError, match="parallel.vpp=2 needs parallel.schedule="):
        plan_job(cfg)
    with pytest.raises(LayoutError, match="parallel.dp_compress=fp16 needs unsharded optimizer"):
        plan_job(_config(dp=2, dp_compress="fp16", zero=1))
