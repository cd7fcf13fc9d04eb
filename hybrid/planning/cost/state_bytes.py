"""What a rank's weights, gradients and optimizer state are made of, for counting their bytes
exactly as ``hybrid.dp`` allocates them (pure: no torch): the local shapes of its parameters
and the gradient buckets they fill. Each sharding strategy counts its bytes from these
(``hybrid.planning.strategies.zero``).

``GradSync`` puts a rank's parameters, in backward order, into fp32 gradient buckets of at
least ``parallel.bucket_mb`` each, with the parameters whose gradients are partial sums over
another group (sequence-parallel norms over TP, a tied embedding split over the pipeline) in
buckets of their own at the end. Under ZeRO-1 each bucket is padded to a multiple of the DP
size, the parameters become views of one flat (padded) buffer per bucket, each rank keeps a
reduced gradient shard of ``1/dp`` of it, and AdamW keeps moments for the parameter slices in
this rank's shard only. ZeRO-2 keeps only the shard of the gradients between steps: a bucket's
full gradients are staged per micro-batch and freed once reduce-scattered. AdamW's state per
tensor it steps: two fp32 moments and a 4-byte step count. The trainer counts the same bytes on every rank and checks them against this
(``memory_check.json``; the end-to-end tests assert every layout they run).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from hybrid.planning.config import ModelConfig
from hybrid.planning.param_spec import DENSE, PLACEMENTS, Placement
from hybrid.planning.params import TIED_HEAD_ALIAS, block_param_specs

MIB = 2**20
FP32 = 4
STEP_COUNT_BYTES = 4


@dataclass(frozen=True)
class StateBytes:
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    dp_state_bytes: int = 0
    """What a DP option keeps besides (``hybrid.planning.cost.dp_traffic.dp_state_bytes``)."""

    def to_dict(self) -> dict:
        return {"param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes,
                "optimizer_bytes": self.optimizer_bytes, "dp_state_bytes": self.dp_state_bytes}


@functools.lru_cache(maxsize=256)
def _block_tensors(model_key: tuple, block_id: int, tp: int, sp: bool, pp: int, ep: int = 1
                   ) -> tuple[tuple[tuple[int, ...], str, str], ...]:
    """(local shape, bucket tag, local name) of a block's parameters in the order the block
    registers them (``attach_specs`` holds the spec table to that order); the tag is
    ``bucket_tag``'s."""
    m = ModelConfig(**dict(model_key))
    out = []
    for local, spec in block_param_specs(m, block_id, sequence_parallel=sp).items():
        late = "tp" if spec.sequence_partial and tp > 1 else (
            "embedding" if spec.tied and pp > 1 else "")
        out.append((spec.local_shape(tp, ep), bucket_tag(late, spec.placement), local))
    return tuple(out)


def bucket_tag(late: str, placement: Placement) -> str:
    """Which buckets a parameter may share: its late axis ("" for the overlapped buckets,
    "tp", "embedding") and, when it is not ``DENSE``, its placement's reduce role after a
    "/" (``GradSync`` keeps one placement per bucket). ``late_axis`` reads the first part."""
    return late if placement == DENSE else f"{late}/{placement.reduce_role}"


def late_axis(tag: str) -> str:
    """The late axis of a ``bucket_tag`` ("": overlapped with the backward)."""
    return tag.partition("/")[0]


def tag_placement(tag: str) -> Placement:
    """The ``Placement`` a ``bucket_tag`` names (``DENSE`` when it names none)."""
    role = tag.partition("/")[2]
    return next((p for p in PLACEMENTS if p.reduce_role == role), DENSE)


def by_tag_placement(items: list, tag_of=lambda item: item[1]) -> dict[Placement, list]:
    """``items`` (each with a bucket tag) split by placement, every placement's in order: its
    buckets are the same as among all (``bucket_members`` keeps placements apart), and each
    placement's are averaged and sharded over its own groups."""
    out: dict[Placement, list] = {}
    for item in items:
        out.setdefault(tag_placement(tag_of(item)), []).append(item)
    return out


def rank_shapes(m: ModelConfig, blocks: list[int], *, tp: int, sp: bool, pp: int, ep: int = 1
                ) -> list[tuple[tuple[int, ...], str]]:
    """(local shape, bucket tag: ``bucket_tag``) of the distinct parameters a rank holding ``blocks``
    (in chunk order) trains: with tied embeddings on one stage the head uses the embedding's
    own weight."""
    key = m.cache_key()
    shared_head = m.tie_embeddings and 0 in blocks and m.layers + 1 in blocks
    return [(shape, late) for block in blocks
            for shape, late, local in _block_tensors(key, block, tp, sp and tp > 1, pp, ep)
            if not (shared_head and block == m.layers + 1 and local == TIED_HEAD_ALIAS)]


def rank_tensors(m: ModelConfig, blocks: list[int], *, tp: int, sp: bool, pp: int
                 ) -> list[tuple[int, str]]:
    """(numel, late bucket or "") of ``rank_shapes``."""
    return [(math.prod(shape), late)
            for shape, late in rank_shapes(m, blocks, tp=tp, sp=sp, pp=pp)]


def bucket_sizes(tensors: list[tuple[int, str]], bucket_mb: float) -> list[list[int]]:
    """Numels per bucket, as ``GradSync._build_buckets`` groups them."""
    return [[tensors[i][0] for i in bucket] for bucket in bucket_members(tensors, bucket_mb)]


def bucket_members(tensors: list[tuple[int, str]], bucket_mb: float) -> list[list[int]]:
    """The indices into ``tensors`` (registration order) of each bucket's parameters, in
    bucket order, as ``hybrid.dp.buckets.build_buckets`` makes them: filled in backward order,
    one placement per bucket (placements in first-seen order), closed at ``bucket_mb``; the
    late ones (summed over another group first) in buckets of their own at the end."""
    limit = int(bucket_mb * MIB)
    late: dict[str, dict[str, list[int]]] = {"tp": {}, "embedding": {}}
    overlapped: dict[str, list[int]] = {}
    for index in reversed(range(len(tensors))):
        tag = tensors[index][1]
        axis = late_axis(tag)
        (late[axis] if axis else overlapped).setdefault(tag, []).append(index)
    buckets = []
    for indices in overlapped.values():
        current, size = [], 0
        for index in indices:
            current.append(index)
            size += tensors[index][0] * FP32
            if size >= limit:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
    return buckets + [indices for by_tag in late.values() for indices in by_tag.values()]
