"""Mixed nodes in the plan (#55, item 3): ``cost.node_devices=[...]`` gives each node its device;
the layers follow the stages' predicted speeds, replicas of unequal speed get
``parallel.dp_balance``'s shares, and every figure is checked against the cost model's own
predictions on one device (never a copied number). Pure and fast: no process starts but the
two ``hybrid-plan`` runs that check what it prints and refuses."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hybrid.planning.balance import best_shares, pipeline_bubble, predicted_step_s
from hybrid.planning.cost.devices import DeviceError
from hybrid.planning.cost.mixed import (
    cluster, mixed_step, node_devices_problem, node_names, plan_mixed,
)
from hybrid.planning.cost.mixed_report import (
    mixed_lines, mixed_prediction, mixed_search, mixed_search_lines,
)
from hybrid.planning.cost.search_limits import search_limits
from hybrid.planning.cost.software import software_named
from hybrid.planning.cost.stage_time import stage_times
from hybrid.planning.cost.steptime import predict_step
from launch.commands.app import compose_plan_config

PLAN = str(Path(sys.executable).parent / "hybrid-plan")
HYBRID = software_named("hybrid")
TWO_NODES = ["model=gpt3-2.7b", "parallel.dp=8", "parallel.pp=2", "parallel.tp=1"]


def mixed(devices: list[str], *overrides: str):
    cfg = compose_plan_config([*TWO_NODES, *overrides,
                               f"cost.node_devices=[{','.join(devices)}]"]).job()
    return plan_mixed(cfg, cluster(cfg, HYBRID, cfg.parallel.pp))


def layers_per_rank(plan) -> list[int]:
    layers = plan.cfg.model.layers
    return [sum(1 for st in plan.stages_of(p) for b in st.blocks if 1 <= b <= layers)
            for p in range(plan.layout.pp)]


def test_the_h100_stage_gets_more_layers_and_beats_the_uniform_split():
    mix = mixed(["a100-80gb", "h100-80gb"])
    a100, h100 = layers_per_rank(mix.plan)
    assert h100 > a100 and layers_per_rank(mix.uniform) == [16, 16]
    split = mixed_step(mix.plan, mix.link, mix.grid)["step_time_s"]
    uniform = mixed_step(mix.uniform, mix.link, mix.grid)["step_time_s"]
    assert split < uniform
    # between the cost model's own uniform clusters of the same layout
    nodes = {d.name: d for d in mix.nodes}
    assert (predict_step(mix.uniform, nodes["h100-80gb"]).step_time_s < split
            < predict_step(mix.uniform, nodes["a100-80gb"]).step_time_s)
    # the other order of the nodes: the first stage is on the H100 and gets the layers
    assert layers_per_rank(mixed(["h100-80gb", "a100-80gb"]).plan)[0] > 16


def test_the_split_is_the_one_whose_slowest_stage_is_fastest():
    """Moving one layer across the boundary either way makes the slower stage slower, as
    the cost model prices each stage on its own device."""
    mix = mixed(["a100-80gb", "h100-80gb"])
    devices = mix.grid[0]
    cut = mix.plan.stages[1].blocks.start

    def slowest_stage(at: int) -> float:
        ranges = [range(0, at), range(at, mix.plan.stages[1].blocks.stop)]
        return max(stage_times(mix.plan, d, r).forward + stage_times(mix.plan, d, r).backward
                   for d, r in zip(devices, ranges))

    assert slowest_stage(cut) < min(slowest_stage(cut - 1), slowest_stage(cut + 1))


def test_one_device_on_every_node_is_the_plan_and_the_step_of_cost_device():
    mix = mixed(["h100-80gb", "h100-80gb"])
    assert mix.plan is mix.uniform and mix.pull is None
    got = mixed_step(mix.plan, mix.link, mix.grid)["step_time_s"]
    assert got == pytest.approx(predict_step(mix.plan, mix.nodes[0]).step_time_s, rel=1e-12)


def test_replicas_on_different_devices_get_the_balancers_shares():
    """pp=1, dp=16: replicas 0-7 on the A100 node, 8-15 on the H100 node. The pipeline is not
    split; the H100 replicas get more micro-batches, the shares ``best_shares`` gives at the
    cost model's per-replica times."""
    mix = mixed(["a100-80gb", "h100-80gb"], "parallel.dp=16", "parallel.pp=1")
    step = mixed_step(mix.plan, mix.link, mix.grid)
    assert step["shares"][0] < step["shares"][-1] and step["step_time_s"] < step["even_step_s"]
    m = mix.plan.schedule.microbatches
    # each replica computes on its node's device; the links are the slower node's
    per_device = {d.name: predict_step(mix.plan, mix.link, rank_devices=[d]) for d in mix.nodes}
    per_mb = [(per_device[row[0].name].compute_s + per_device[row[0].name].bubble_s) / m
              for row in mix.grid]
    assert step["shares"] == list(best_shares(per_mb, m * 16))
    said = mixed_lines(mixed_prediction(mix))
    assert f"dp_balance=dynamic's shares {step['shares']} (even shares: " in said
    rest = max(p.step_time_s - p.compute_s - p.bubble_s for p in per_device.values())
    assert step["step_time_s"] == pytest.approx(
        predicted_step_s(per_mb, step["shares"], pipeline_bubble(1, 1)) + rest, rel=1e-12)


def test_a_split_that_would_not_fit_memory_is_held_back():
    """gpt3-2.7b dp=8 pp=2 with dualpipev at micro-batch 4: all of the speed's split puts
    more on the H100 than 80 GiB holds; the plan follows the speeds less far, and fits."""
    mix = mixed(["a100-80gb", "h100-80gb"], "parallel.schedule=dualpipev", "parallel.vpp=2",
                "train.micro_batch=4")
    assert mix.pull is not None and mix.pull < 1
    assert max(est.total_bytes for est in mix.plan.memory) <= mix.nodes[0].memory_bytes
    assert layers_per_rank(mix.plan)[1] > layers_per_rank(mix.plan)[0]


def test_a_list_of_the_wrong_length_or_an_unknown_device_is_refused_in_one_line():
    three = "cost.node_devices=[a100-80gb,h100-80gb,a100-80gb]"
    cfg = compose_plan_config(["model=gpt3-2.7b", "parallel.dp=8", "parallel.pp=2", three])
    assert node_devices_problem(cfg, 32) == (
        "cost.node_devices=[a100-80gb, h100-80gb, a100-80gb] names 3 node(s) but the job's 32 "
        "ranks (parallel.dp=8 x cp=1 x tp=2 x pp=2) fill 4 node(s) of 8 (cost.gpus_per_node); "
        "give 4 devices (one per node) or a number of devices that divides 4 (one per group "
        "of consecutive nodes), or place 11 ranks per node, or use a layout of 24 ranks")
    placed = replace(cfg, launcher=replace(cfg.launcher, nnodes=3))
    assert node_devices_problem(placed, 33) is None  # the launcher's 3 nodes of 11
    five = replace(cfg, cost=replace(cfg.cost, node_devices=["a100-80gb"] * 5))
    assert "names 5 node(s)" in node_devices_problem(five, 32)  # more than the nodes
    bad = replace(cfg, cost=replace(cfg.cost, node_devices=["a100-80gb", "b100"]))
    with pytest.raises(DeviceError, match=r"^cost.node_devices\[1\]: cost.device=b100 is "):
        cluster(bad, HYBRID, 2)
    done = subprocess.run([PLAN, "model=gpt3-2.7b", "parallel.dp=8", "parallel.pp=2", three],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"error: {node_devices_problem(cfg, 32)}"]


def test_the_issues_command_reads_two_devices_as_two_halves_of_four_nodes():
    """``model=gpt3-2.7b parallel.dp=8 parallel.pp=2`` keeps the preset's tp=2: 32 ranks, 4
    nodes of 8. Two devices name two groups of two consecutive nodes: pp rank 0 (ranks 0-15)
    on the A100s, pp rank 1 on the H100s."""
    issue = ["model=gpt3-2.7b", "parallel.dp=8", "parallel.pp=2",
             "cost.node_devices=[a100-80gb,h100-80gb]"]
    cfg = compose_plan_config(issue)
    assert node_devices_problem(cfg, 32) is None
    assert node_names(cfg) == ["a100-80gb", "a100-80gb", "h100-80gb", "h100-80gb"]
    four = compose_plan_config([*issue[:-1], "cost.node_devices=[a100-80gb,a100-80gb,"
                                "h100-80gb,h100-80gb]"])
    job = cfg.job()
    mix = plan_mixed(job, cluster(cfg, HYBRID, 2))
    same = plan_mixed(four.job(), cluster(four, HYBRID, 2))  # the list written out in full
    assert [d.name for d in mix.nodes] == [d.name for d in same.nodes]
    a100, h100 = layers_per_rank(mix.plan)
    assert h100 > a100 and layers_per_rank(mix.plan) == layers_per_rank(same.plan)
    split = mixed_step(mix.plan, mix.link, mix.grid)["step_time_s"]
    assert split < mixed_step(mix.uniform, mix.link, mix.grid)["step_time_s"]
    done = subprocess.run([PLAN, *issue], capture_output=True, text=True, timeout=120,
                          check=True)
    assert ("cost.node_devices names 2 devices for 4 nodes: each names 2 consecutive nodes "
            "(nodes 0-1: a100-80gb, nodes 2-3: h100-80gb)") in done.stdout
    assert f"  node 3: h100-80gb  pp rank 1: {h100} layers" in done.stdout
    assert f"mixed cluster: step {split:.4g} s; the same layout split as" in done.stdout


def test_hybrid_plan_prints_each_nodes_device_its_stages_and_the_comparisons():
    done = subprocess.run([PLAN, *TWO_NODES, "cost.node_devices=[a100-80gb,h100-80gb]"],
                          capture_output=True, text=True, timeout=120, check=True)
    mix = mixed(["a100-80gb", "h100-80gb"])
    a100, h100 = layers_per_rank(mix.plan)
    assert f"  node 0: a100-80gb  pp rank 0: {a100} layers" in done.stdout
    assert f"  node 1: h100-80gb  pp rank 1: {h100} layers" in done.stdout
    split = mixed_step(mix.plan, mix.link, mix.grid)["step_time_s"]
    assert f"mixed cluster: step {split:.4g} s; the same layout split as" in done.stdout
    assert "the mix costs +" in done.stdout and "against all h100-80gb" in done.stdout


def test_the_search_on_a_mixed_cluster_ranks_layouts_apart_from_either_uniform_cluster():
    plan_cfg = compose_plan_config(["model=gpt3-2.7b", "search.world=16", "search.top=8",
                                    "search.keep=[train.micro_batch,model.recompute,"
                                    "parallel.zero]", "cost.node_devices=[a100-80gb,h100-80gb]"])
    limits = search_limits(plan_cfg, HYBRID, plan_cfg.search.keep, None)
    result = mixed_search(plan_cfg, 16, HYBRID, 8, limits)
    rows = result["candidates"]
    assert [r["step_time_s"] for r in rows] == sorted(r["step_time_s"] for r in rows)
    for name in ("a100-80gb", "h100-80gb"):  # each uniform cluster orders them otherwise
        ranks = [r["uniform_rank"][name] or 99 for r in rows]
        assert ranks != sorted(ranks), name
    first = rows[0]  # its step is the one plan_mixed and mixed_step give for its settings
    from hybrid.planning.cost.mixed_report import config_of

    cfg = config_of(plan_cfg, first["settings"])
    again = plan_mixed(cfg, cluster(plan_cfg, HYBRID, cfg.parallel.pp))
    assert mixed_step(again.plan, again.link, again.grid)["step_time_s"] == first["step_time_s"]
    text = mixed_search_lines(result)
    assert "against the best uniform cluster (all h100-80gb" in text
    assert "its slower nodes hold back the stages or replicas they run" in text  # the reason
    assert text.count("on the mix") == 2


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_one_cost_list_for_every_stage_splits_as_the_balanced_partitioner(pp):
    """``partition_per_stage`` is the balanced partitioner with a list per stage: given the
    same list for every stage it gives ``partition(mode="balanced")``'s split; a stage twice
    as fast (its costs halved) takes more layers."""
    from hybrid.planning.schedules.partition import PartitionError, partition, partition_per_stage

    costs = [3.0] + [float(5 + (i * 7) % 4) for i in range(12)] + [11.0]
    assert partition_per_stage([costs] * pp) == partition(costs, pp, mode="balanced")
    fast_last = [costs] * (pp - 1) + [[c / 2 for c in costs]]
    assert len(partition_per_stage(fast_last)[-1]) > len(partition(costs, pp, mode="balanced")[-1])
    with pytest.raises(PartitionError, match="same model"):
        partition_per_stage([costs, costs[:-1]])
