"""What one rank builds from the job's plan: its model chunks, every pipeline rank's action
list (lowered and checked), and the shape of the activations stages exchange."""

from __future__ import annotations

from typing import Optional

from torch import nn

from hybrid.groups import ParallelGroups
from hybrid.model import build_blocks
from hybrid.planning.job import JobPlan
from hybrid.planning.rank_lists import lowered_lists
from hybrid.planning.schedules.actions import Action


def build_chunks(plan: JobPlan, groups: ParallelGroups) -> dict[int, nn.Module]:
    """This pipeline rank's model chunks: virtual stage id -> ``nn.Sequential`` of blocks.

    The rank's blocks are built in one call, so that a tied head on the rank that also holds
    the embedding (the V placement puts both on rank 0) shares its Parameter, as at pp=1.
    """
    cfg = plan.cfg
    stages = plan.stages_of(groups.pp_rank)
    held = sorted(block for stage in stages for block in stage.blocks)
    built = dict(zip(held, build_blocks(cfg.model, groups, seed=cfg.seed, block_ids=held,
                                        sequence_parallel=cfg.parallel.sequence_parallel,
                                        cp_comm=cfg.parallel.cp_comm)))
    return {stage.index: nn.Sequential(*(built[b] for b in stage.blocks)) for stage in stages}


def lowered_schedule(plan: JobPlan, forward: bool = False,
                     m: Optional[int] = None) -> list[list[Action]]:
    """Every pipeline rank's action list with sends/receives, and under ZeRO-3 its gathers
    and releases, proved safe by the checker: the plan's own for a training step of its
    micro-batches; ``forward``: an evaluation's (forwards only); ``m``: another count of
    micro-batches per step (a replica's own under ``parallel.dp_balance=dynamic``)."""
    m = plan.schedule.microbatches if m is None else m
    if not forward and m == plan.schedule.microbatches and plan.lowered:
        return [list(actions) for actions in plan.lowered]
    return lowered_lists(plan.cfg, plan.layout, m, forward=forward)


def activation_shape(plan: JobPlan) -> tuple[int, int, int]:
    """``[s, b, h]`` between stages; the sequence is split over CP (each rank's chunks), then
    over TP with sequence parallelism."""
    cfg = plan.cfg
    seq = cfg.model.seq_len // plan.layout.cp
    if cfg.parallel.sequence_parallel:
        seq //= plan.layout.tp
    return (seq, cfg.train.micro_batch, cfg.model.hidden)
