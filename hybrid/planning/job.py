"""One frozen plan of a job (pure: no torch): ``plan_job(cfg) -> JobPlan``.

Built once, before any worker starts, from the config as Hydra composed it (nothing resolved is
written back into the config): the layout and where its ranks land, the pipeline stages (which
blocks, on which pipeline rank as which chunk: ``schedules.stage_map.stage_rank`` /
``stage_chunk``, with the schedule's ``layout.stage_placement``), the schedule and its
simulated shape, the micro-batches per step, the DP strategies, the memory each pipeline rank
needs (``rank_memory``), and, for a run, its checkpoint directory and the checkpoint it resumes
from. ``hybrid-train`` saves it as ``plan.json`` beside ``config.json`` (``plan_file``) and
every rank reads it: what ``hybrid-plan`` prints, what the trainer builds its chunks and
schedule from, and what the memory check and the cost model price all come from this one
object.

One thing is left to the ranks: ``parallel.partition=measured`` without known costs splits
the stages by predicted FLOPs until the ranks have timed the blocks; they then call
``with_block_costs`` (the one re-planning, pure and identical on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from hybrid.planning.config import Config
from hybrid.planning.cost.gathered import gather_policy, gathers_by_placement, rank_gathers
from hybrid.planning.cost.sizes import MemoryEstimate
from hybrid.planning.cost.dp_traffic import gradient_bytes, step_bytes
from hybrid.planning.cost.state_bytes import by_tag_placement, rank_shapes
from hybrid.planning.models.moe import expert_bias_payload
from hybrid.planning.param_spec import DENSE, EXPERT
from hybrid.planning.layout import EMBEDDING, ROLES, Layout, role_key
from hybrid.planning.rank_memory import ranks_memory, with_gathered
from hybrid.planning.rank_lists import lowered_lists
from hybrid.planning.schedules.actions import Action, stage_chunk, stage_rank
from hybrid.planning.cost.block_costs import partition_costs, partition_for_config
from hybrid.planning.strategies import (SCALAR, DpOptions, all_reduce_bytes, reduction_of,
                                        sharding_of)
from hybrid.planning.schedules.shapes import closed_form_schedule, simulate_unit_costs
from hybrid.planning.validate import microbatches, ranks_per_node, validate_config


@dataclass(frozen=True)
class Stage:
    """One virtual pipeline stage, in model order."""

    index: int
    pp_rank: int
    """The pipeline rank that runs it."""
    chunk: int
    """Which of that rank's ``vpp`` chunks it is."""
    blocks: range
    """Block ids: 0 the embedding, 1..L the layers, L+1 the head."""


@dataclass(frozen=True)
class SchedulePlan:
    """The schedule's shape, simulated with unit costs (F=1, B=2, I=W=1)."""

    name: str
    microbatches: int
    simulated: bool
    """False: the closed forms of ``closed_form_schedule`` (searches of many layouts)."""
    bubble_fraction: float
    bubble_per_rank: tuple[float, ...]
    peak_inflight: tuple[int, ...]
    """Per pipeline rank: most micro-batches whose activations are held at once."""


RUN_FIELDS = ("ranks_per_node", "checkpoint_dir", "resume_from", "init_from", "data_prefixes",
              "data_cache_dir", "tokenizer", "peak_flops")
"""What a run adds to a plan (where it runs and reads and writes), kept when it is re-planned."""


@dataclass(frozen=True)
class JobPlan:
    cfg: Config
    """The config as composed (never changed)."""
    layout: Layout
    ranks_per_node: int
    """Ranks each node runs, as the launcher places them (node ``i``: ranks ``i * n ...``)."""
    stages: tuple[Stage, ...]
    schedule: SchedulePlan
    memory: tuple[MemoryEstimate, ...]
    """Per pipeline rank (every rank of a pipeline rank holds the same shards)."""
    by_rank: tuple[tuple[int, ...], ...]
    """Per pipeline rank, the stages it runs by chunk."""
    priced_ranks_per_node: int = 0
    """Ranks per node as the cost model prices the links: the launcher's when it places the
    nodes, else ``cost.gpus_per_node`` (the target machine, not this one)."""
    block_costs: Optional[tuple[float, ...]] = None
    """partition=measured: the per-block costs the stages were split by."""
    costs_measured: bool = True
    """False: ``block_costs`` are predicted FLOPs, and the ranks measure before training."""
    checkpoint_dir: Optional[str] = None
    """Where this run's checkpoints go (set for a run by ``for_run``)."""
    resume_from: Optional[str] = None
    """The checkpoint this run resumes from, checked before launch (None: a fresh start)."""
    init_from: Optional[str] = None
    """The checkpoint whose model weights a fresh run starts from (checked before launch)."""
    tokenizer: Optional[dict] = None
    """The data's tokenizer record (``hybrid.data.tokenizer.TokenizerInfo``), when it has one:
    checkpoints carry it, so that export and generation can decode."""
    peak_flops: Optional[float] = None
    """One device's peak FLOP/s at train.precision on ``cost.device``: what MFU divides by."""
    data_prefixes: tuple[str, ...] = ()
    """data.source=indexed: the data sets' prefixes, absolute (resolved where hybrid-train
    ran), in the order of ``data.path``/``data.blend``."""
    data_cache_dir: Optional[str] = None
    """data.source=indexed: where megatron-core's index caches are (built before launch)."""
    lowered: tuple[tuple[Action, ...], ...] = ()
    """Per pipeline rank, the training step's action list as the runtime runs it: lowered
    with sends, receives and ZeRO-3's gathers, and checked (``rank_lists``); empty in a plan
    of the closed forms (``simulated=False``: searches of many layouts)."""

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return self.layout.node_of(rank, self.ranks_per_node)

    def stages_of(self, pp_rank: int) -> list[Stage]:
        """The stages ``pp_rank`` runs, by chunk."""
        return [self.stages[s] for s in self.by_rank[pp_rank]]

    def memory_of(self, rank: int) -> MemoryEstimate:
        return self.memory[self.layout.coords(rank)["pp"]]

    @property
    def dp_strategies(self) -> tuple[str, str]:
        """(sharding, reduction): the DP strategies' names."""
        options = DpOptions.of(self.cfg.parallel)
        return sharding_of(options).name, reduction_of(options).name

    def role_groups(self) -> dict[str, list[list[int]]]:
        """Every role's groups, as global rank lists."""
        return {role: self.layout.role_groups(role) for role in (*ROLES, EMBEDDING)}

    def for_run(self, *, checkpoint_dir: str, resume_from: Optional[str],
                init_from: Optional[str] = None,
                peak_flops: Optional[float] = None) -> "JobPlan":
        """This plan for a run whose checkpoints go to ``checkpoint_dir``."""
        return replace(self, checkpoint_dir=checkpoint_dir, resume_from=resume_from,
                       init_from=init_from, peak_flops=peak_flops)

    def with_tokenizer(self, record: dict) -> "JobPlan":
        """This plan with the data's tokenizer record."""
        return replace(self, tokenizer=record)

    def with_data(self, prefixes: tuple[str, ...], cache_dir: str) -> "JobPlan":
        """This plan reading indexed data at ``prefixes``, its index caches in ``cache_dir``."""
        return replace(self, data_prefixes=tuple(prefixes), data_cache_dir=cache_dir)

    def placed(self, ranks_per_node: int) -> "JobPlan":
        """This plan on nodes of ``ranks_per_node`` ranks (what a plain torchrun started)."""
        return replace(self, ranks_per_node=ranks_per_node)

    def with_block_costs(self, costs: list[float]) -> "JobPlan":
        """partition=measured: the stages split by the costs the ranks measured."""
        again = plan_job(self.cfg, block_costs=costs)
        return replace(again, **{name: getattr(self, name) for name in RUN_FIELDS})


    def with_stage_ranges(self, ranges: list[range]) -> "JobPlan":
        """This plan with the stages holding ``ranges`` of blocks (``parallel.pp_balance=
        dynamic``'s split; the same per-block costs)."""
        costs = list(self.block_costs) if self.block_costs and self.costs_measured else None
        again = plan_job(self.cfg, block_costs=costs, stage_ranges=ranges)
        return replace(again, **{name: getattr(self, name) for name in RUN_FIELDS})


def plan_job(cfg: Config, simulated: bool = True,
             block_costs: Optional[list[float]] = None,
             stage_ranges: Optional[list[range]] = None, lower: bool = True) -> JobPlan:
    """Validate ``cfg`` (``LayoutError`` with one line) and plan it; ``simulated=False``
    takes the schedule's shape and the ranks' state bytes from closed forms instead of
    simulating the schedule and laying out the gradient buckets (what searches need).
    ``block_costs``: partition=measured's measured costs (a calibration file's, or the
    ranks'), else ``parallel.block_costs``, else predicted FLOPs until the ranks measure.
    ``stage_ranges``: the blocks of each virtual stage, split elsewhere (``cost.node_devices``:
    by each stage's device, ``hybrid.planning.cost.mixed``). ``lower=False``: without the
    runtime's lowered lists (and their check), which no prediction reads: what a search's
    and the published runs' predictions plan (a 405B search lowered 46 plans for nothing)."""
    layout = validate_config(cfg)
    costs, measured = partition_costs(cfg, block_costs)
    ranges = partition_for_config(cfg, costs) if stage_ranges is None else list(stage_ranges)
    pp = layout.pp
    stages = tuple(Stage(index=s, pp_rank=stage_rank(s, pp, layout.stage_placement),
                         chunk=stage_chunk(s, pp, layout.stage_placement),
                         blocks=blocks) for s, blocks in enumerate(ranges))
    schedule = _schedule_plan(cfg.parallel.schedule, pp, microbatches(cfg), layout.vpp,
                              simulated)
    by_rank = _stages_by_rank(stages, pp)
    chunks = [[list(stages[s].blocks) for s in by_rank[r]] for r in range(pp)]
    memory = ranks_memory(cfg, layout, chunks, schedule.peak_inflight, simulated)
    if gather_policy(cfg) is not None:
        memory = with_gathered(cfg, layout, memory, by_rank, chunks, simulated)
    placed = ranks_per_node(cfg, layout)
    lowered = () if not (simulated and lower) else tuple(
        tuple(actions) for actions in lowered_lists(cfg, layout, schedule.microbatches))
    return JobPlan(cfg=cfg, layout=layout, ranks_per_node=placed, stages=stages,
                   schedule=schedule, memory=memory, by_rank=by_rank, lowered=lowered,
                   priced_ranks_per_node=_priced_ranks_per_node(cfg, layout, placed),
                   block_costs=tuple(costs) if cfg.parallel.partition == "measured" else None,
                   costs_measured=measured)


def _priced_ranks_per_node(cfg: Config, layout: Layout, placed: int) -> int:
    """The launcher's placement when it places the nodes, else ``cost.gpus_per_node``."""
    launcher = cfg.launcher
    if launcher.nnodes > 1 or launcher.nproc_per_node is not None:
        return placed
    return min(layout.world_size, cfg.cost.gpus_per_node)


def _stages_by_rank(stages: tuple[Stage, ...], pp: int) -> tuple[tuple[int, ...], ...]:
    """``rank_stages`` for every rank in one pass (searches plan pp=128 layouts)."""
    held: list[list[Stage]] = [[] for _ in range(pp)]
    for stage in stages:
        held[stage.pp_rank].append(stage)
    return tuple(tuple(st.index for st in sorted(ranks, key=lambda st: st.chunk))
                 for ranks in held)


def _schedule_plan(name: str, pp: int, m: int, vpp: int, simulated: bool) -> SchedulePlan:
    if not simulated:
        bubble, peak = closed_form_schedule(name, pp, m, vpp)
        return SchedulePlan(name=name, microbatches=m, simulated=False,
                            bubble_fraction=bubble, bubble_per_rank=(bubble,) * pp,
                            peak_inflight=peak)
    sim = simulate_unit_costs(name, pp, m, vpp)
    return SchedulePlan(name=name, microbatches=m, simulated=True,
                        bubble_fraction=sim.bubble_fraction,
                        bubble_per_rank=tuple(sim.bubble_per_rank),
                        peak_inflight=tuple(sim.peak_inflight))


def rank_dp_bytes(cfg: Config, plan: JobPlan, pp_rank: int, step: int,
                  options: Optional[DpOptions] = None, rounds: Optional[int] = None) -> float:
    """Bytes a rank of pipeline rank ``pp_rank`` sends over DP in step ``step`` under
    ``options`` (default: the config's), as ``hybrid.comm.CommCounter`` counts them.
    ``rounds``: the most micro-batches a replica ran in the step (``dp_balance=dynamic``:
    ZeRO-2 reduce-scatters that many times on every replica; default the even count)."""
    return sum(rank_dp_group_bytes(cfg, plan, pp_rank, step, options, rounds).values())


def rank_dp_group_bytes(cfg: Config, plan: JobPlan, pp_rank: int, step: int,
                        options: Optional[DpOptions] = None,
                        rounds: Optional[int] = None) -> dict[str, float]:
    """``rank_dp_bytes`` per group, by the label ``CommCounter.group_bytes`` counts it under:
    the dense gradient group's (``cp-dp``) and, at ``ep > 1``, the expert gradient group's
    (``edp``), each placement's buckets over its own group."""
    blocks = [b for stage in plan.stages_of(pp_rank) for b in stage.blocks]
    shapes = rank_shapes(cfg.model, blocks, tp=plan.layout.tp,
                         sp=cfg.parallel.sequence_parallel, pp=plan.layout.pp)
    options = options or DpOptions.of(cfg.parallel)
    gathers = None
    stages = [(st.index, list(st.blocks)) for st in plan.stages_of(pp_rank)]
    if sharding_of(options).gathers_params:
        gathers = rank_gathers(cfg, plan.layout, pp_rank, microbatches(cfg), stages,
                               policy=options.reshard)[1]
    # the aux-loss-free expert bias's routed slots, summed over the ranks with other tokens
    bias = all_reduce_bytes(expert_bias_payload(cfg.model, blocks),
                            plan.layout.role_size("loss"))
    dense = role_key(DENSE.reduce_role)
    assert role_key("loss") == dense  # the bias's sum is counted with the dense buckets
    if plan.layout.ep > 1:
        by_placement = gathers and gathers_by_placement(cfg, plan.layout, gathers, stages)
        groups = _expert_parallel_dp_bytes(cfg, plan.layout, blocks, step, options,
                                           rounds or microbatches(cfg), by_placement)
        return {**groups, dense: bias + groups[dense]}
    return {dense: bias + step_bytes(shapes, dp=plan.layout.role_size("gradient"), step=step,
                                     microbatches=rounds or microbatches(cfg), options=options,
                                     bucket_mb=cfg.parallel.bucket_mb, gathers=gathers)}


def _expert_parallel_dp_bytes(cfg: Config, layout: Layout, blocks: list[int], step: int,
                              options: DpOptions, rounds: int,
                              gathers: Optional[dict] = None) -> dict[str, float]:
    """``rank_dp_group_bytes`` at ``ep > 1`` (the bias's aside): the dense buckets over
    dp x cp (with the step's loss and norm scalars), the experts' over their expert
    data-parallel group (with, when the state is sharded, the norm's sum over it);
    ``gathers``: ZeRO-3's gathers per bucket of each placement."""
    gathers = gathers or {}
    shapes = rank_shapes(cfg.model, blocks, tp=layout.tp, sp=cfg.parallel.sequence_parallel,
                         pp=layout.pp, ep=layout.ep)
    parts = by_tag_placement(shapes)
    dense = step_bytes(parts.get(DENSE, []), dp=layout.role_size("gradient"), step=step,
                       microbatches=rounds, options=options, bucket_mb=cfg.parallel.bucket_mb,
                       gathers=gathers.get(DENSE))
    edp = layout.role_size(EXPERT.reduce_role)
    norm = all_reduce_bytes(SCALAR, edp) if sharding_of(options).shards_optimizer else 0.0
    experts = gradient_bytes(parts.get(EXPERT, []), dp=edp, step=step, microbatches=rounds,
                             options=options, bucket_mb=cfg.parallel.bucket_mb,
                             gathers=gathers.get(EXPERT))
    return {role_key(DENSE.reduce_role): dense, role_key(EXPERT.reduce_role): norm + experts}
