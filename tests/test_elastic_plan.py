"""Planning as a function of (config, surviving world): ``hybrid.planning.elastic``, without
processes. A re-plan keeps the config's model, global batch, micro-batch and schedule; it
shrinks DP first, then changes the pipeline, then TP; a TP group never spans nodes."""

import copy

import pytest

from hybrid.planning.config import (CheckpointConfig, Config, LauncherConfig, ModelConfig,
                                    ParallelConfig, TrainConfig, to_dict)
from hybrid.planning.elastic import NoLayoutFits, elastic_problem, layout_text, replan


def config(dp=2, tp=2, pp=2, nnodes=2, per_node=4, global_batch=8, micro_batch=1, layers=4,
           every=2, min_nodes=1, **parallel) -> Config:
    return Config(model=ModelConfig(layers=layers),
                  parallel=ParallelConfig(dp=dp, tp=tp, pp=pp, **parallel),
                  train=TrainConfig(global_batch=global_batch, micro_batch=micro_batch),
                  checkpoint=CheckpointConfig(every=every),
                  launcher=LauncherConfig(name="torchrun", nnodes=nnodes, nproc_per_node=per_node,
                                          rdzv_endpoint="127.0.0.1:1", min_nodes=min_nodes))


def sizes(plan):
    return plan.layout.dp, plan.layout.tp, plan.layout.pp


def test_dp_shrinks_first_and_each_replica_runs_more_micro_batches():
    cfg = config()
    before = copy.deepcopy(to_dict(cfg))
    plan = replan(cfg, nodes=1, ranks_per_node=4)
    assert sizes(plan) == (1, 2, 2) and plan.ranks_per_node == 4 and plan.nodes == 1
    assert plan.schedule.microbatches == 8  # 8 / (dp 1 x micro 1): was 4 on dp 2
    assert plan.cfg.train.global_batch == 8 and plan.cfg.train.micro_batch == 1
    assert plan.cfg.launcher.nnodes == 1 and plan.cfg.launcher.node_rank == 0
    assert to_dict(cfg) == before  # the composed config is never changed
    assert layout_text(plan) == "dp 1 x tp 2 x pp 2 on 1 node x 4 ranks, 8 micro-batches " \
                                "per replica"


def test_dp4_tp2_on_two_nodes_goes_on_as_dp2():
    plan = replan(config(dp=4, pp=1), nodes=1, ranks_per_node=4)
    assert sizes(plan) == (2, 2, 1) and plan.schedule.microbatches == 4


def test_the_same_world_plans_the_same_layout():
    cfg = config()
    assert sizes(replan(cfg, nodes=2, ranks_per_node=4)) == (2, 2, 2)


def test_the_pipeline_changes_when_dp_alone_cannot_shrink():
    # dp 1 x tp 2 x pp 4 on 2 nodes of 4: one node cannot hold pp 4 with tp 2 -> pp 2
    plan = replan(config(dp=1, tp=2, pp=4, layers=8), nodes=1, ranks_per_node=4)
    assert sizes(plan) == (1, 2, 2)


def test_tp_changes_last():
    # tp 4 x pp 2 over nodes of 4: one node keeps tp 4 and drops to pp 1
    assert sizes(replan(config(dp=1, tp=4, pp=2), nodes=1, ranks_per_node=4)) == (1, 4, 1)
    # three nodes of 2 ranks, tp 2 x pp 3: two nodes hold 4 ranks; pp 3 cannot divide them
    cfg = config(dp=1, tp=2, pp=3, nnodes=3, per_node=2, layers=6)
    assert sizes(replan(cfg, nodes=2, ranks_per_node=2)) == (1, 2, 2)


def test_a_global_batch_dp_cannot_split_moves_the_ranks_to_another_axis():
    # global batch 3: dp 2 cannot split it, so two ranks run tp 2 (or pp 2) with dp 1
    plan = replan(config(dp=3, tp=1, pp=1, nnodes=3, per_node=1, global_batch=3), nodes=2,
                  ranks_per_node=1)
    assert plan.world_size == 2 and sizes(plan) in {(1, 2, 1), (1, 1, 2)}


def test_a_tp_group_never_spans_nodes():
    # tp 4 is kept only where a node holds 4 ranks: on nodes of 2 it drops to 2
    plan = replan(config(dp=1, tp=4, pp=1, per_node=2, nnodes=2), nodes=1, ranks_per_node=2)
    assert plan.layout.tp <= 2


def test_nothing_left_says_so_in_one_line():
    with pytest.raises(NoLayoutFits) as err:
        replan(config(), nodes=0, ranks_per_node=4)
    assert "\n" not in str(err.value) and "nothing is left" in str(err.value)


def test_no_layout_when_the_schedule_needs_more_ranks():
    # interleaved 1F1B needs pp >= 2: a single node of one rank cannot run it
    cfg = config(dp=1, tp=1, pp=2, nnodes=2, per_node=1, vpp=2, schedule="interleaved-1f1b")
    with pytest.raises(NoLayoutFits) as err:
        replan(cfg, nodes=1, ranks_per_node=1)
    line = str(err.value)
    assert "\n" not in line and line.startswith("no layout of the config fits 1 node(s) x 1")
    assert "train.global_batch=8" in line and "interleaved-1f1b needs parallel.pp >= 2" in line


@pytest.mark.parametrize("change, expected", [
    (dict(min_nodes=3), "launcher.min_nodes=3 must be in 1..launcher.nnodes=2"),
    (dict(min_nodes=0), "launcher.min_nodes=0 must be in 1..launcher.nnodes=2"),
    (dict(every=0), "launcher.min_nodes=1 needs checkpoint.every > 0"),
    (dict(tp=8, dp=1, pp=1), "a TP group spans nodes"),
])
def test_refused_before_launch(change, expected):
    assert expected in elastic_problem(config(**change))


def test_refused_when_a_surviving_set_holds_no_layout():
    cfg = config(dp=1, tp=1, pp=2, nnodes=2, per_node=1, vpp=2, schedule="interleaved-1f1b")
    problem = elastic_problem(cfg)
    assert problem.startswith("launcher.min_nodes=1: no layout of the config fits 1 node(s)")


def test_no_min_nodes_no_problem():
    assert elastic_problem(config(min_nodes=None)) is None
    assert elastic_problem(config()) is None


def test_on_slurm_min_nodes_keeps_the_job_and_its_step_when_a_node_fails():
    """``launcher=slurm``: the same checks as torchrun; the job is submitted ``--no-kill``
    (sbatch and srun) instead of ending at the first node that fails."""
    from dataclasses import replace

    from hybrid.planning.job import plan_job
    from launch.launchers.slurm import SlurmLauncher, sbatch_parameters

    def slurm(cfg):
        return replace(cfg, launcher=replace(cfg.launcher, name="slurm", rdzv_endpoint=None))

    elastic, plain = slurm(config()), slurm(config(min_nodes=None))
    assert SlurmLauncher().config_problem(elastic) is None
    assert SlurmLauncher().config_problem(slurm(config(min_nodes=3))).startswith(
        "launcher.min_nodes=3 must be in 1..launcher.nnodes=2")
    kept = sbatch_parameters(plan_job(elastic, simulated=False))
    assert kept["srun_args"] == ["--no-kill"] and kept["additional_parameters"]["no_kill"]
    ended = sbatch_parameters(plan_job(plain, simulated=False))
    assert ended["srun_args"] == ["--kill-on-bad-exit=1"] and "additional_parameters" not in ended
