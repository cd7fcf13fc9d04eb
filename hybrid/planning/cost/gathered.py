"""ZeRO-3's gathered weights (pure; no torch): the most bytes of whole weights a rank holds at
once during a step, and how often each of its buckets is gathered, from the schedule's
``UNSHARD``/``RESHARD`` actions (``hybrid.planning.schedules.gathers``) walked over the same
buckets ``hybrid.dp`` builds. The trainer counts both and ``memory_check.json`` and the
end-to-end tests hold them equal.

The closed form (searches) does not walk: ``after_step`` holds every block of the rank at
once; ``after_forward`` one block and the next one, gathered behind it.
"""

from __future__ import annotations

import math
from typing import Optional

from hybrid.planning.config import Config
from hybrid.planning.cost.state_bytes import FP32, bucket_members, bucket_tag, tag_placement
from hybrid.planning.layout import Layout
from hybrid.planning.params import TIED_HEAD_ALIAS, block_param_specs
from hybrid.planning.schedules import build_schedule
from hybrid.planning.schedules.gathers import AFTER_STEP, add_gathers, walk_gathers
from hybrid.planning.strategies import DpOptions, sharding_of


def gather_policy(cfg: Config) -> Optional[str]:
    """``parallel.zero3_reshard`` when the sharding gathers weights per use, else None."""
    options = DpOptions.of(cfg.parallel)
    return options.reshard if sharding_of(options).gathers_params else None


def rank_gathers(cfg: Config, layout: Layout, pp_rank: int, m: int,
                 stages: list[tuple[int, list[int]]],
                 policy: Optional[str] = None) -> tuple[int, list[int]]:
    """(peak gathered bytes, gathers per bucket) of pipeline rank ``pp_rank`` in one step of
    ``m`` micro-batches; ``stages``: (stage, blocks) of the stages it holds, by chunk;
    ``policy``: the release policy (default: the config's, which must be ZeRO-3's)."""
    policy = policy or gather_policy(cfg)
    assert policy is not None, "only ZeRO-3 gathers weights"
    tensors = _tensor_units(cfg, layout, stages)
    members = bucket_members([(numel, late) for numel, late, _ in tensors],
                             cfg.parallel.bucket_mb)
    sizes = []
    for bucket in members:  # padded for the shards of its placement's sharding group
        d = layout.role_size(tag_placement(tensors[bucket[0]][1]).shard_role)
        sizes.append(FP32 * -(-sum(tensors[i][0] for i in bucket) // d) * d)
    units = {stage: [frozenset(b for b, bucket in enumerate(members)
                               if any((stage, k) in tensors[i][2] for i in bucket))
                     for k in range(len(blocks))]
             for stage, blocks in stages}
    actions = add_gathers(build_schedule(cfg.parallel.schedule, layout.pp, m, vpp=layout.vpp),
                          policy)[pp_rank]
    return walk_gathers(actions, units, sizes, policy)


def gathers_by_placement(cfg: Config, layout: Layout, gathers: list[int],
                         stages: list[tuple[int, list[int]]]) -> dict:
    """``rank_gathers``' gathers per bucket split by the buckets' placements, each in bucket
    order (what each placement's own traffic over its sharding group is counted from)."""
    tensors = _tensor_units(cfg, layout, stages)
    members = bucket_members([(numel, late) for numel, late, _ in tensors],
                             cfg.parallel.bucket_mb)
    out: dict = {}
    for bucket, count in zip(members, gathers):
        out.setdefault(tag_placement(tensors[bucket[0]][1]), []).append(count)
    return out


def closed_form_gathered(stage_blocks: list[list[int]], policy: str) -> int:
    """The walk's peak without buckets (``stage_blocks``: each stage's blocks' parameter
    counts): every block of the rank (``after_step``), else the largest two neighbouring
    blocks of a stage (one computing while the next is gathered)."""
    if policy == AFTER_STEP:
        return FP32 * sum(sum(blocks) for blocks in stage_blocks)
    return FP32 * max((a + b for blocks in stage_blocks for a, b in zip(blocks, blocks[1:])),
                      default=max((sum(blocks) for blocks in stage_blocks), default=0))


def _tensor_units(cfg: Config, layout: Layout, stages: list[tuple[int, list[int]]]
                  ) -> list[tuple[int, str, set[tuple[int, int]]]]:
    """(numel, bucket tag (``state_bytes.bucket_tag``), the (stage, block position) units using it) of the rank's
    distinct parameters in registration order (``state_bytes.rank_shapes``' order): a tied
    head on the rank that holds the embedding uses the embedding's own weight."""
    m, tp, pp = cfg.model, layout.tp, layout.pp
    sp = cfg.parallel.sequence_parallel and tp > 1
    held = {b for _, blocks in stages for b in blocks}
    shared_head = m.tie_embeddings and 0 in held and m.layers + 1 in held
    out: list[tuple[int, str, set[tuple[int, int]]]] = []
    index_of: dict[str, int] = {}
    for stage, blocks in stages:
        for position, block in enumerate(blocks):
            for local, spec in block_param_specs(m, block, sequence_parallel=sp).items():
                if shared_head and block == m.layers + 1 and local == TIED_HEAD_ALIAS:
                    out[index_of[spec.name]][2].add((stage, position))
                    continue
                late = "tp" if spec.sequence_partial and tp > 1 else (
                    "embedding" if spec.tied and pp > 1 else "")
                index_of[spec.name] = len(out)
                out.append((math.prod(spec.local_shape(tp, layout.ep)),
                            bucket_tag(late, spec.placement),
                            {(stage, position)}))
    return out
