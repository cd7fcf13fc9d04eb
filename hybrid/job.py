"""One typed plan of a job (pure: no torch): ``plan_job(cfg) -> JobPlan``.

The layout and where its ranks land, the pipeline stages (which blocks, on which pipeline rank
as which chunk: ``hybrid.pipeline.actions.stage_rank`` / ``stage_chunk``, the one placement
function), the schedule's simulated shape, and the memory each pipeline rank needs. What
``hybrid-plan`` prints, what the trainer builds its chunks from and what the memory check and
the cost model price are all read from this one object.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.config import Config
from hybrid.cost import MemoryEstimate, estimate_memory
from hybrid.layout import Layout
from hybrid.pipeline.actions import rank_stages, stage_chunk, stage_rank
from hybrid.validate import microbatches, ranks_per_node, validate_config


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
    bubble_fraction: float
    bubble_per_rank: tuple[float, ...]
    peak_inflight: tuple[int, ...]
    """Per pipeline rank: most micro-batches whose activations are held at once."""


@dataclass(frozen=True)
class JobPlan:
    cfg: Config
    layout: Layout
    ranks_per_node: int
    stages: tuple[Stage, ...]
    schedule: SchedulePlan
    memory: tuple[MemoryEstimate, ...]
    """Per pipeline rank (every rank of a pipeline rank holds the same shards)."""

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
        return [self.stages[s] for s in rank_stages(pp_rank, self.layout.pp, self.layout.vpp)]

    def memory_of(self, rank: int) -> MemoryEstimate:
        return self.memory[self.layout.coords(rank)["pp"]]


def plan_job(cfg: Config) -> JobPlan:
    """Validate ``cfg`` (``LayoutError`` with one line) and plan it."""
    from hybrid.pipeline.plan import partition_for_config, simulate_unit_costs

    layout = validate_config(cfg)
    ranges = partition_for_config(cfg)
    pp = layout.pp
    stages = tuple(Stage(index=s, pp_rank=stage_rank(s, pp), chunk=stage_chunk(s, pp),
                         blocks=blocks) for s, blocks in enumerate(ranges))
    m = microbatches(cfg)
    sim = simulate_unit_costs(cfg.parallel.schedule, pp, m, layout.vpp)
    schedule = SchedulePlan(name=cfg.parallel.schedule, microbatches=m,
                            bubble_fraction=sim.bubble_fraction,
                            bubble_per_rank=tuple(sim.bubble_per_rank),
                            peak_inflight=tuple(sim.peak_inflight))
    memory = tuple(_rank_memory(cfg, layout, [list(st.blocks) for st in stages
                                              if st.pp_rank == r], sim.peak_inflight[r])
                   for r in range(pp))
    return JobPlan(cfg=cfg, layout=layout, ranks_per_node=ranks_per_node(cfg, layout),
                   stages=stages, schedule=schedule, memory=memory)


def _rank_memory(cfg: Config, layout: Layout, chunks: list[list[int]],
                 inflight: int) -> MemoryEstimate:
    held = [block for chunk in chunks for block in chunk]
    return estimate_memory(
        cfg.model, chunks, tp=layout.tp, dp=layout.dp, zero=cfg.parallel.zero,
        micro_batch=cfg.train.micro_batch, inflight=inflight,
        sp=cfg.parallel.sequence_parallel, precision=cfg.train.precision,
        embedding_copy=cfg.model.tie_embeddings and 0 not in held)
