"""What each pipeline rank of a plan holds (pure: no torch): its memory estimate, its
weights, gradients and optimizer state byte for byte, and ZeRO-3's gathered working set.

``plan_job`` (``hybrid.planning.job``) fills ``JobPlan.memory`` from ``ranks_memory`` and,
under ZeRO-3, ``with_gathered``: exactly (``rank_state_bytes``, the buckets and schedule
walked) for a plan, or in closed form, ranks alike in chunk shape computed once, for the
searches. The trainer checks what it allocates against ``rank_state_bytes``
(``hybrid.memory_check``); the check of a plan against a device's memory is
``hybrid.planning.memory``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hybrid.planning.config import Config
from hybrid.planning.cost.gathered import closed_form_gathered, gather_policy, rank_gathers
from hybrid.planning.cost.sizes import MemoryEstimate, block_params, estimate_memories
from hybrid.planning.cost.dp_traffic import dp_state_bytes
from hybrid.planning.cost.state_bytes import StateBytes, by_tag_placement, rank_shapes
from hybrid.planning.param_spec import DENSE
from hybrid.planning.layout import Layout
from hybrid.planning.schedules import schedule_spec
from hybrid.planning.strategies import DpOptions, reduction_of, sharding_of
from hybrid.planning.validate import microbatches


def ranks_memory(cfg: Config, layout: Layout, chunks: list[list[list[int]]],
                  inflight: tuple[int, ...], exact: bool) -> tuple[MemoryEstimate, ...]:
    """Each pipeline rank's estimate. In closed form, ranks whose chunks hold the same
    numbers of layers (and the embedding or head alike) are estimated together, what they
    share computed once, for each number of micro-batches in flight they keep (a search plans
    layouts of 128 stages)."""
    if exact:
        return tuple(_rank_memory(cfg, layout, chunks[r], (inflight[r],), exact=True)[0]
                     for r in range(layout.pp))
    alike: dict = {}  # chunk shape -> (first rank of it, {in-flight count: its index})
    shape_of = []
    for r in range(layout.pp):
        key = _chunk_shape(cfg, chunks[r])
        first, counts = alike.setdefault(key, (r, {}))
        counts.setdefault(inflight[r], len(counts))
        shape_of.append(key)
    estimates = {key: _rank_memory(cfg, layout, chunks[first], tuple(counts), exact=False)
                 for key, (first, counts) in alike.items()}
    return tuple(estimates[key][alike[key][1][inflight[r]]] for r, key in enumerate(shape_of))


def _chunk_shape(cfg: Config, chunks: list[list[int]]) -> tuple:
    """What a rank's closed-form estimates read of its chunks: each one's number of blocks
    and whether it holds the embedding or the head (the layers are all alike)."""
    edges = (0, cfg.model.layers + 1)
    return tuple((len(chunk), *(edge in chunk for edge in edges)) for chunk in chunks)


def _rank_memory(cfg: Config, layout: Layout, chunks: list[list[int]],
                 inflights: tuple[int, ...], exact: bool) -> list[MemoryEstimate]:
    """The rank's estimate with each of ``inflights`` micro-batches in flight. ``exact``:
    weights, gradients and optimizer state byte for byte as the trainer allocates them on DP
    rank 0 (``rank_state_bytes``), else in closed form (searches)."""
    held = [block for chunk in chunks for block in chunk]
    state = rank_state_bytes(cfg, layout, held, dp_rank=0) if exact else None
    estimates = estimate_memories(
        cfg.model, chunks, tp=layout.tp, cp=layout.cp, dp=layout.role_size("sharding"),
        zero=cfg.parallel.zero,
        micro_batch=cfg.train.micro_batch, inflights=inflights,
        sp=cfg.parallel.sequence_parallel, precision=cfg.train.precision,
        embedding_copy=cfg.model.tie_embeddings and 0 not in held,
        head_inflight=schedule_spec(cfg.parallel.schedule).last_stage_holds(microbatches(cfg)),
        state=state)
    options = DpOptions.of(cfg.parallel)
    if exact or reduction_of(options).exact:  # (searches plan exact options only: fast)
        return estimates
    shapes = rank_shapes(cfg.model, held, tp=layout.tp, sp=cfg.parallel.sequence_parallel,
                         pp=layout.pp)
    extra = dp_state_bytes(shapes, dp=layout.role_size("gradient"), options=options)
    return [replace(estimate, dp_state_bytes=extra) for estimate in estimates]


def rank_state_bytes(cfg: Config, layout: Layout, blocks: list[int], dp_rank: int,
                     expert_rank: int = 0) -> StateBytes:
    """Bytes of weights, gradients and AdamW state on the rank holding ``blocks`` at place
    ``dp_rank`` of its sharding group (dp x cp) and ``expert_rank`` of its experts' (each
    placement's buckets are sharded over its own group)."""
    shapes = rank_shapes(cfg.model, blocks, tp=layout.tp,
                         sp=cfg.parallel.sequence_parallel, pp=layout.pp, ep=layout.ep)
    options = DpOptions.of(cfg.parallel)
    sums = [0, 0, 0]
    for placement, part in by_tag_placement(shapes).items():
        held = sharding_of(options).state_bytes(
            [(math.prod(shape), tag) for shape, tag in part],
            dp=layout.role_size(placement.shard_role),
            dp_rank=dp_rank if placement == DENSE else expert_rank,
            bucket_mb=cfg.parallel.bucket_mb)
        sums = [a + b for a, b in zip(sums, (held.param_bytes, held.grad_bytes,
                                              held.optimizer_bytes))]
    extra = dp_state_bytes(shapes, dp=layout.role_size("gradient"), options=options)
    return StateBytes(*sums, dp_state_bytes=extra)


def with_gathered(cfg: Config, layout: Layout, memory: tuple[MemoryEstimate, ...],
                   by_rank: tuple, chunks: list[list[list[int]]], exact: bool
                   ) -> tuple[MemoryEstimate, ...]:
    """``memory`` with ZeRO-3's gathered working set; in closed form, ranks alike in chunk
    shape gather alike, and it is computed once for them."""
    keys = [r if exact else _chunk_shape(cfg, chunks[r]) for r in range(layout.pp)]
    gathered: dict = {}
    for r, key in enumerate(keys):
        if key not in gathered:
            gathered[key] = _gathered_bytes(cfg, layout, r, list(zip(by_rank[r], chunks[r])),
                                            exact)
    return tuple(replace(est, gathered_bytes=gathered[key]) for est, key in zip(memory, keys))


def _gathered_bytes(cfg: Config, layout: Layout, pp_rank: int,
                    stages: list[tuple[int, list[int]]], exact: bool) -> int:
    """ZeRO-3's gathered working set on ``pp_rank``: walked over its buckets and schedule
    (``exact``), else in closed form."""
    if exact:
        return rank_gathers(cfg, layout, pp_rank, microbatches(cfg), stages)[0]
    embedding_copy = cfg.model.tie_embeddings and all(0 not in b for _, b in stages)
    per_block = block_params(cfg.model, head_owns_embedding_copy=embedding_copy)
    return closed_form_gathered([[per_block[i].per_rank(layout.tp) for i in blocks]
                                 for _, blocks in stages], gather_policy(cfg))
