"""The frozen job plan: built once before launch, saved as plan.json, read back equal, and
never written into the config."""

import copy
import json

import pytest

from hybrid.planning.config import (
    CheckpointConfig, Config, LauncherConfig, ModelConfig, ParallelConfig, TrainConfig, to_dict,
)
from hybrid.planning.job import plan_job
from hybrid.planning.plan_file import PlanFileError, load_plan, plan_from_dict, plan_to_dict, \
    save_plan

LAYOUTS = {
    "2x2x2 1f1b zero1": ParallelConfig(dp=2, tp=2, pp=2, zero=1),
    "pp4 interleaved": ParallelConfig(pp=4, vpp=2, schedule="interleaved-1f1b"),
    "pp2 zb-v tied": ParallelConfig(pp=2, vpp=2, schedule="zb-v"),
    "dp2 powersgd": ParallelConfig(dp=2, dp_compress="powersgd"),
    "measured": ParallelConfig(pp=2, partition="measured"),
    "pp2 dualpipev": ParallelConfig(pp=2, vpp=2, schedule="dualpipev"),
    "dp2 pp2 zero3": ParallelConfig(dp=2, pp=2, zero=3),
}


def config(parallel: ParallelConfig) -> Config:
    return Config(model=ModelConfig(layers=8, tie_embeddings=True), parallel=parallel,
                  train=TrainConfig(global_batch=16, micro_batch=2),
                  launcher=LauncherConfig(nproc_per_node=None))


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_plan_reads_back_equal_from_its_file(name, tmp_path):
    plan = plan_job(config(LAYOUTS[name])).for_run(checkpoint_dir="/ckpt", resume_from=None)
    path = save_plan(plan, tmp_path)
    assert load_plan(tmp_path) == plan == plan_from_dict(json.loads(path.read_text()))
    written = json.loads(path.read_text())
    assert written["groups"]["gradient"] == plan.layout.role_groups("gradient")
    assert written["dp_strategies"] == dict(zip(("sharding", "reduction"), plan.dp_strategies))


def test_planning_writes_nothing_into_the_config():
    cfg = config(ParallelConfig(pp=2, partition="measured"))
    cfg.checkpoint = CheckpointConfig(resume_from="auto")
    before = copy.deepcopy(to_dict(cfg))
    plan = plan_job(cfg, block_costs=[1.0] * 10).for_run(checkpoint_dir="/c", resume_from="/c/s")
    assert to_dict(cfg) == before and plan.cfg is cfg
    assert plan.costs_measured and plan.block_costs == (1.0,) * 10
    assert plan.checkpoint_dir == "/c" and plan.resume_from == "/c/s"


def test_measured_costs_re_split_only_the_stages():
    plan = plan_job(config(ParallelConfig(pp=2, partition="measured")))
    assert not plan.costs_measured  # predicted FLOPs until the ranks measure
    heavy_head = [0.0] + [1.0] * 8 + [8.0]
    settled = plan.for_run(checkpoint_dir="/c", resume_from=None).with_block_costs(heavy_head)
    assert settled.costs_measured and settled.checkpoint_dir == "/c"
    assert settled.stages != plan.stages and settled.layout == plan.layout


def test_ranks_per_node_are_decided_in_one_place():
    cfg = config(ParallelConfig(dp=2, tp=2, pp=2))
    plan = plan_job(cfg)
    assert plan.ranks_per_node == 8 and plan.priced_ranks_per_node == min(8, cfg.cost.gpus_per_node)
    cfg.launcher = LauncherConfig(name="torchrun", nnodes=2, rdzv_endpoint="h:1")
    plan = plan_job(cfg)
    assert plan.ranks_per_node == plan.priced_ranks_per_node == 4
    assert plan.placed(2).node_of(5) == 2  # a plain torchrun's placement


def test_a_plan_file_of_another_format_is_refused(tmp_path):
    data = plan_to_dict(plan_job(config(ParallelConfig())))
    data["format"] = 99
    with pytest.raises(PlanFileError, match="plan format 99"):
        plan_from_dict(data)


@pytest.mark.parametrize("name", ["pp2 dualpipev", "dp2 pp2 zero3", "pp4 interleaved"])
def test_the_plan_holds_the_lowered_lists_the_runtime_runs(name, tmp_path):
    from dataclasses import replace

    from hybrid.pipeline.stages import lowered_schedule
    from hybrid.planning.rank_lists import lowered_lists
    from hybrid.planning.schedules.check import check_schedule

    plan = plan_job(config(LAYOUTS[name]))
    layout, m = plan.layout, plan.schedule.microbatches
    assert [list(a) for a in plan.lowered] == lowered_lists(plan.cfg, layout, m)
    check_schedule([list(a) for a in plan.lowered], layout.pp, m, layout.vpp,
                   layout.stage_placement)
    written = json.loads(save_plan(plan, tmp_path).read_text())["lowered"]
    assert written == [[str(a) for a in actions] for actions in plan.lowered]
    assert any(t.startswith(("1SEND_F", "2RECV_F", "1RECV_F")) for t in written[1] + written[0])
    if "zero3" in name:
        assert any("UNSHARD" in t for t in written[0])
    swapped = replace(plan, lowered=tuple(reversed(plan.lowered)))  # what the plan says runs
    assert lowered_schedule(swapped) == [list(a) for a in reversed(plan.lowered)]
    assert lowered_schedule(plan, m=2 * m) == lowered_lists(plan.cfg, layout, 2 * m)


def test_a_plan_of_closed_forms_holds_no_lists():
    assert plan_job(config(LAYOUTS["pp2 dualpipev"]), simulated=False).lowered == ()
