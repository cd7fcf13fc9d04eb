"""Mixed nodes in the plan: ``cost.node_devices=[a100-80gb, h100-80gb]`` (pure: no torch).

One device (a preset or a device file, as ``cost.device`` takes) per node. The nodes are
those the cost model prices: ``launcher.nnodes`` when the launcher places the nodes, else
the job's ranks in nodes of ``cost.gpus_per_node`` (what ``JobPlan.priced_ranks_per_node``
says); node ``i`` holds ranks ``i * per_node`` onwards. A list shorter than the nodes whose
length divides their number names consecutive equal groups of nodes (``[a100, h100]`` on four
nodes: nodes 0-1 A100, nodes 2-3 H100), as a cluster bought in two halves is racked and as
the ranks fill the nodes (``node_names``; ``hybrid-plan`` prints the reading). Any other
length is refused.

Every (replica, pipeline rank) cell computes at the pace of the slowest device among its
ranks (a TP or CP group waits for its slowest member). The layers are split by each pipeline
rank's device: every block's forward and backward seconds on that device, from the cost
model (``stage_time``), and the contiguous split that minimises the largest stage
(``schedules.partition.partition_per_stage``, the balanced partitioner with a cost list per
stage). The split is the same in every replica, so a pipeline rank whose replicas sit on
different devices is split for its slowest. Replicas whose pipelines differ in speed get the
micro-batch shares ``parallel.dp_balance=dynamic`` would choose (``balance.best_shares``, as
``cost.replica_speed`` is priced). Links (pipeline sends, the DP reduction) are priced on the
slowest node's device: a ring or a send runs at its slowest member. A split that would not
fit the smallest node's memory follows the speeds less far (``PULLS``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from hybrid.planning.balance import (
    balance_problem, best_shares, pipeline_bubble, predicted_step_s, share_unit,
)
from hybrid.planning.config import Config
from hybrid.planning.cost.devices import Device, DeviceError, device_for
from hybrid.planning.cost.stage_time import stage_times
from hybrid.planning.cost.steptime import predict_step
from hybrid.planning.job import JobPlan, plan_job
from hybrid.planning.schedules.actions import stage_rank
from hybrid.planning.schedules.partition import partition_per_stage


def node_shape(cfg: Config, world: int) -> tuple[int, int, str]:
    """(nodes, ranks per node, which setting says so) for ``world`` ranks, as the cost model
    places them (``job._priced_ranks_per_node``)."""
    launcher = cfg.launcher
    if launcher.nnodes > 1 or launcher.nproc_per_node is not None:
        per_node = launcher.nproc_per_node or max(1, world // launcher.nnodes)
        said = "launcher.nnodes / launcher.nproc_per_node"
    else:
        per_node, said = max(1, min(world, cfg.cost.gpus_per_node)), "cost.gpus_per_node"
    return -(-world // per_node), per_node, said


def node_devices_problem(cfg: Config, world: int) -> Optional[str]:
    """Why ``cost.node_devices`` cannot be priced on ``world`` ranks (one line), else None."""
    names = cfg.cost.node_devices
    if names is None:
        return None
    nodes, per_node, said = node_shape(cfg, world)
    if names and len(names) <= nodes and nodes % len(names) == 0:
        return None  # one per node, or one per consecutive group of nodes (node_names)
    shown = "[" + ", ".join(map(str, names)) + "]"
    par = cfg.parallel
    sizes = (f" (parallel.dp={par.dp} x cp={par.cp} x tp={par.tp} x pp={par.pp})"
             if world == par.dp * par.cp * par.tp * par.pp else "")
    # the one-line fix names the numbers: the nodes the list would need, and the ranks
    # per node (or ranks in all) that would make the list's length right
    wanted = -(-world // len(names)) if names else per_node
    return (f"cost.node_devices={shown} names {len(names)} node(s) but the job's {world} "
            f"ranks{sizes} fill {nodes} node(s) of {per_node} ({said}); give {nodes} "
            f"devices (one per node) or a number of devices that divides {nodes} (one per "
            f"group of consecutive nodes), or place {wanted} ranks per node, or use a layout "
            f"of {len(names) * per_node} ranks")


def node_names(cfg: Config, world: Optional[int] = None) -> list[str]:
    """Each node's device name: ``cost.node_devices`` as given when it names every node,
    else each name repeated for its group of consecutive nodes (``node_devices_problem``
    has refused any other length). ``world``: the job's ranks (default: the layout's)."""
    par = cfg.parallel
    world = world or par.dp * par.cp * par.tp * par.pp
    names = [str(n) for n in cfg.cost.node_devices]
    nodes = node_shape(cfg, world)[0]
    group = max(1, nodes // len(names))
    return [names[i // group] for i in range(nodes)] if len(names) < nodes else names


def node_groups_line(cfg: Config, world: Optional[int] = None) -> Optional[str]:
    """How a list shorter than the nodes was read (one line), else None."""
    names = [str(n) for n in cfg.cost.node_devices]
    expanded = node_names(cfg, world)
    if len(expanded) == len(names):
        return None
    group = len(expanded) // len(names)
    spans = ", ".join(f"nodes {i * group}-{(i + 1) * group - 1}: {name}"
                      for i, name in enumerate(names))
    return (f"cost.node_devices names {len(names)} devices for {len(expanded)} nodes: each "
            f"names {group} consecutive nodes ({spans})")


def cluster(cfg: Config, software, pp: int, world: Optional[int] = None) -> list[Device]:
    """Each node's device, as ``software`` drives it on ``pp`` stages (``cost.device``'s
    rules: a preset or a device file, ``cost.inter_node_gbit`` applied); a list shorter
    than the nodes is read as ``node_names`` reads it."""
    devices, known = [], {}
    listed = [str(n) for n in cfg.cost.node_devices]
    for name in node_names(cfg, world):
        if name not in known:
            try:
                device = device_for(replace(cfg.cost, device=name))
            except DeviceError as err:
                raise DeviceError(f"cost.node_devices[{listed.index(name)}]: {err}") from None
            known[name] = software.device(device, pp)
        devices.append(known[name])
    return devices


def layer_seconds(plan: JobPlan, device: Device) -> float:
    """One layer's forward and backward of one micro-batch on ``device``: what ranks the
    devices by speed."""
    times = stage_times(plan, device, range(1, 2))
    return times.forward + times.backward


def slowest(plan: JobPlan, devices: Sequence[Device]) -> Device:
    distinct = {d.name: d for d in devices}.values()
    return max(distinct, key=lambda d: (layer_seconds(plan, d), d.name))


def cell_devices(plan: JobPlan, nodes: Sequence[Device]) -> list[list[Device]]:
    """``grid[replica][pp_rank]``: the device that cell computes at (its slowest rank's)."""
    layout, per_node = plan.layout, plan.priced_ranks_per_node
    held: dict = {}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        held.setdefault((c["dp"], c["pp"]), {})[nodes[rank // per_node].name] = \
            nodes[rank // per_node]
    known: dict = {}  # the slowest of each set of devices, priced once
    grid = []
    for r in range(layout.dp):
        row = []
        for p in range(layout.pp):
            names = tuple(sorted(held[(r, p)]))
            if names not in known:
                known[names] = slowest(plan, list(held[(r, p)].values()))
            row.append(known[names])
        grid.append(row)
    return grid


def block_seconds(plan: JobPlan, device: Device) -> list[float]:
    """Every block's forward and backward seconds on ``device`` (one micro-batch)."""
    model, known = plan.cfg.model, {}
    out = []
    for block in range(model.layers + 2):
        kind = (block == 0, block == model.layers + 1,
                1 <= block <= model.layers and model.is_moe_layer(block))
        if kind not in known:
            times = stage_times(plan, device, range(block, block + 1))
            known[kind] = times.forward + times.backward
        out.append(known[kind])
    return out


def speed_split(plan: JobPlan, rank_devices: Sequence[Device], pull: float = 1.0
                ) -> Optional[list[range]]:
    """The stages' blocks split by their pipeline ranks' devices; None when every pipeline
    rank has the same device (the config's own partition stands). ``pull`` below 1 weighs
    each device's block seconds with the slowest device's, moving layers back towards the
    slower stages (0: every stage priced as the slowest)."""
    if len({d.name for d in rank_devices}) == 1:
        return None
    layout = plan.layout
    costs = {d.name: block_seconds(plan, d) for d in rank_devices}
    floor = costs[slowest(plan, rank_devices).name]
    costs = {name: [pull * c + (1 - pull) * f for c, f in zip(own, floor)]
             for name, own in costs.items()}
    return partition_per_stage(
        [costs[rank_devices[stage_rank(s, layout.pp, layout.stage_placement)].name]
         for s in range(layout.pp * layout.vpp)])


PULLS = (1.0, 0.75, 0.5, 0.25, 0.0)
"""How far the split follows the devices' speeds, tried in turn until every rank fits its
memory: a fast device's extra layers bring their weights, optimizer state and activations."""


@dataclass(frozen=True)
class MixedPlan:
    plan: JobPlan
    """The plan with the layers split by the pipeline ranks' devices."""
    uniform: JobPlan
    """The same layout split as the config says (uniform by default)."""
    nodes: tuple[Device, ...]
    grid: tuple[tuple[Device, ...], ...]
    """``grid[replica][pp_rank]``: each cell's device (``cell_devices``)."""
    link: Device
    """The slowest node's device: the links and the memory check."""
    pull: Optional[float] = None
    """How far the split follows the devices' speeds (``PULLS``; 1: all the way, below 1:
    held back by memory); None: the config's split (one device per pipeline rank, or no
    split by speed fits)."""


def plan_mixed(cfg: Config, nodes: Sequence[Device], simulated: bool = True,
               block_costs: Optional[list[float]] = None) -> MixedPlan:
    """``cfg`` planned on ``nodes`` (one device per node): the split that follows the
    devices' speeds furthest (``PULLS``) while every rank fits the smallest memory of the
    nodes; the config's split when none does."""
    uniform = plan_job(cfg, simulated, block_costs)
    grid = cell_devices(uniform, nodes)
    per_rank = [slowest(uniform, [row[p] for row in grid]) for p in range(uniform.layout.pp)]
    memory = min(d.memory_bytes for d in nodes)
    plan, pull = uniform, None
    for tried in PULLS:
        ranges = speed_split(uniform, per_rank, tried)
        if ranges is None:
            break
        split = plan_job(cfg, simulated, block_costs, ranges)
        if max(est.total_bytes for est in split.memory) <= memory:
            plan, pull = split, tried
            break
    return MixedPlan(plan=plan, uniform=uniform, nodes=tuple(nodes),
                     grid=tuple(tuple(row) for row in grid), link=slowest(uniform, nodes),
                     pull=pull)


def mixed_step(plan: JobPlan, link: Device, grid: Sequence[Sequence[Device]],
               simulated: bool = True) -> dict:
    """The step of ``plan`` on ``grid``'s devices: each replica's pipeline priced on its own
    devices (``predict_step``'s ``rank_devices``), the replicas under even shares and under
    ``parallel.dp_balance=dynamic``'s, what is not the pipeline added to both."""
    rows: dict = {}
    for row in grid:
        key = tuple(d.name for d in row)
        if key not in rows:
            rows[key] = predict_step(plan, link, simulated, rank_devices=row)
    each = [rows[tuple(d.name for d in row)] for row in grid]
    m, layout = plan.schedule.microbatches, plan.layout
    bubble = pipeline_bubble(layout.pp, layout.vpp)
    pipeline = [p.compute_s + p.bubble_s for p in each]
    rest = max(max(0.0, p.step_time_s - s) for p, s in zip(each, pipeline))
    per_mb = [s / (m + bubble) for s in pipeline]
    even = (m,) * layout.dp
    shares = best_shares(per_mb, m * layout.dp, bubble=bubble,
                         unit=share_unit(plan.cfg.parallel.schedule, layout.pp))
    even_s = predicted_step_s(per_mb, even, bubble) + rest
    balanced_s = predicted_step_s(per_mb, shares, bubble) + rest
    dynamic = replace(plan.cfg.parallel, dp_balance="dynamic")
    if balanced_s >= even_s or balance_problem(dynamic):  # dynamic shares cannot run: even
        balanced_s, shares = even_s, even
    return {"even_step_s": even_s, "step_time_s": balanced_s,
            "shares": list(shares),
            "slowest": max(each, key=lambda p: p.step_time_s)}
