"""Planning as a function of (config, world): the layout a job goes on with when nodes leave
(pure: no torch).

``replan(cfg, nodes, ranks_per_node)`` plans the composed config again for the nodes that are
left, within the same config: the model, seed, data, ``train.global_batch``, micro-batch,
schedule and DP strategies stay; only the layout and the nodes change. Each replica then runs
more micro-batches, so every step still sees the same global batch and a run that shrinks
trains the same losses (layout invariance) from the checkpoint it resumes.

The layouts are tried in this order, the first that validates wins:

1. the most ranks the survivors hold (every rank of every node, then one fewer per node, ...);
2. at that size, data parallelism shrunk alone (tp, cp and pp kept), then pipeline stages
   changed too (pp, largest first), then tensor parallelism (tp, largest first);
3. a TP group never spans nodes (its all-reduces run in every layer).

When none fits, ``NoLayoutFits`` says why in one line (the DP-only shrink's problem).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Optional

from hybrid.planning.config import Config
from hybrid.planning.job import JobPlan, plan_job
from hybrid.planning.layout import LayoutError


class NoLayoutFits(LayoutError):
    """No layout of the config fits the nodes that are left (one line: why)."""


@dataclass(frozen=True)
class Shape:
    """One candidate: the parallel sizes and the ranks each node runs."""

    dp: int
    tp: int
    pp: int
    ranks_per_node: int

    def text(self, cp: int = 1) -> str:
        cp_part = f" x cp {cp}" if cp > 1 else ""
        return f"dp {self.dp}{cp_part} x tp {self.tp} x pp {self.pp}"


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def candidate_shapes(cfg: Config, nodes: int, ranks_per_node: int) -> Iterator[Shape]:
    """Every layout the survivors could run, in the order of preference (module docstring)."""
    par = cfg.parallel
    for per_node in range(ranks_per_node, 0, -1):
        world = nodes * per_node
        if world % par.cp:
            continue
        tps = [par.tp] + [t for t in _divisors_desc(world) if t != par.tp]
        for tp in tps:
            pps = [par.pp] + [p for p in _divisors_desc(world) if p != par.pp]
            for pp in pps:
                rest = world // par.cp
                if rest % (tp * pp):
                    continue
                yield Shape(dp=rest // (tp * pp), tp=tp, pp=pp, ranks_per_node=per_node)


def config_for(cfg: Config, shape: Shape, nodes: int, node_rank: int = 0) -> Config:
    """``cfg`` with ``shape``'s layout on ``nodes`` nodes: what the config would have said had
    the job been started on them (a new object; the composed config is never changed)."""
    parallel = replace(cfg.parallel, dp=shape.dp, tp=shape.tp, pp=shape.pp)
    launcher = replace(cfg.launcher, nnodes=nodes, nproc_per_node=shape.ranks_per_node,
                       node_rank=node_rank)
    return replace(cfg, parallel=parallel, launcher=launcher)


def shape_problem(cfg: Config, shape: Shape, nodes: int) -> Optional[str]:
    """Why ``shape`` cannot run the config on ``nodes`` nodes (one line), or None."""
    if shape.tp > shape.ranks_per_node or shape.ranks_per_node % shape.tp:
        return (f"tp {shape.tp} does not fit in a node of {shape.ranks_per_node} ranks: a TP "
                f"group would span nodes")
    try:
        plan_job(config_for(cfg, shape, nodes), simulated=False)
    except LayoutError as err:
        return str(err)
    return None


def replan(cfg: Config, nodes: int, ranks_per_node: int, node_rank: int = 0) -> JobPlan:
    """The plan of ``cfg`` on ``nodes`` nodes of at most ``ranks_per_node`` ranks each, as
    this node (``node_rank``) runs it; ``NoLayoutFits`` (one line) when none fits."""
    if nodes < 1 or ranks_per_node < 1:
        raise NoLayoutFits(f"no layout fits {nodes} node(s) x {ranks_per_node} ranks: "
                           f"nothing is left to run on")
    first_problem = None
    for shape in candidate_shapes(cfg, nodes, ranks_per_node):
        problem = shape_problem(cfg, shape, nodes)
        if problem is None:
            return plan_job(config_for(cfg, shape, nodes, node_rank))
        if first_problem is None:
            first_problem = f"{shape.text(cfg.parallel.cp)}: {problem}"
    raise NoLayoutFits(
        f"no layout of the config fits {nodes} node(s) x {ranks_per_node} ranks keeping "
        f"train.global_batch={cfg.train.global_batch} (first tried {first_problem}); "
        f"raise launcher.min_nodes, or choose a global batch and model that smaller layouts "
        f"divide")


def layout_text(plan: JobPlan) -> str:
    """``dp 1 x tp 2 x pp 2 on 1 node x 4 ranks, 4 micro-batches per replica``."""
    layout = plan.layout
    shape = Shape(dp=layout.dp, tp=layout.tp, pp=layout.pp, ranks_per_node=plan.ranks_per_node)
    nodes = plan.nodes
    return (f"{shape.text(layout.cp)} on {nodes} node{'s' * (nodes > 1)} x "
            f"{plan.ranks_per_node} ranks, {plan.schedule.microbatches} micro-batch"
            f"{'es' * (plan.schedule.microbatches > 1)} per replica")


def elastic_problem(cfg: Config) -> Optional[str]:
    """What ``launcher.min_nodes`` needs of a config, in one line, or None: checked before
    anything starts, so that no node loss the job allows can leave it without a layout."""
    launcher = cfg.launcher
    k = launcher.min_nodes
    if k is None:
        return None
    if k < 1 or k > launcher.nnodes:
        return (f"launcher.min_nodes={k} must be in 1..launcher.nnodes={launcher.nnodes}: the "
                f"fewest nodes the job goes on with")
    if cfg.checkpoint.every <= 0:
        return (f"launcher.min_nodes={k} needs checkpoint.every > 0: after a node leaves, the "
                f"survivors resume from the newest checkpoint")
    per_node = launcher.nproc_per_node or (
        cfg.parallel.dp * cfg.parallel.cp * cfg.parallel.tp * cfg.parallel.pp // launcher.nnodes)
    if cfg.parallel.tp > per_node or per_node % cfg.parallel.tp:
        return (f"launcher.min_nodes={k} with parallel.tp={cfg.parallel.tp} over nodes of "
                f"{per_node} ranks: a TP group spans nodes, so any node that leaves breaks "
                f"every TP group; choose tp dividing launcher.nproc_per_node")
    for nodes in range(k, launcher.nnodes):
        try:
            replan(cfg, nodes, per_node)
        except NoLayoutFits as err:
            return f"launcher.min_nodes={k}: {err}"
    return None
