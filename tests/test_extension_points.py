"""A new pipeline schedule and a new DP strategy, registered from this file alone, train through
the trainer on 2 ranks: no core module knows them (docs/architecture.md, "where a change goes").

- ``reverse-gpipe``: GPipe with the backwards in reverse micro-batch order (the last forward's
  backward first, as torch's first GPipe did); one ``ScheduleSpec``.
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
from hybrid.planning.schedules.actions import BACKWARD, FORWARD, Action
from hybrid.planning.strategies import REDUCTIONS, ReductionSpec, register_reduction
from hybrid.testing.accounting import checked_records
from hybrid.testing import spawn

pytestmark = pytest.mark.timeout(300)
FP16 = 2


def _reverse_gpipe(pp: int, m: int, vpp: int) -> list[list[Action]]:
    return [[Action(r, FORWARD, mb) for mb in range(m)]
            + [Action(r, BACKWARD, mb) for mb in reversed(range(m))] for r in range(pp)]


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
    register_schedule(REVERSE_GPIPE)
    register_reduction(Fp16())


@pytest.fixture(scope="module", autouse=True)
def registered():
    register()
    yield
    SCHEDULES.pop(REVERSE_GPIPE.name)
    REDUCTIONS.pop("fp16")


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
    return Trainer(plan, ParallelGroups.create(plan.layout), Path(run_dir)).run()["losses"]


def _run(cfg: Config, run_dir: Path) -> list[float]:
    plan = plan_job(cfg)  # validation and planning accept the registered names
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg)))
    save_plan(plan, run_dir)
    losses = spawn(_train, plan.world_size, plan_to_dict(plan), str(run_dir), timeout=240)[0]
    assert [r["loss"] for r in checked_records(run_dir)] == losses  # bytes as predicted
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    return _run(_config(), tmp_path_factory.mktemp("single") / "run")


def test_a_schedule_registered_here_trains_like_the_one_process_model(reference, tmp_path):
    losses = _run(_config(pp=2, schedule="reverse-gpipe"), tmp_path / "run")
    assert losses == pytest.approx(reference, rel=1e-5)


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
