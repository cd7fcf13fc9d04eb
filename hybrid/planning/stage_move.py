"""Who sends which layer's state to whom when ``parallel.pp_balance=dynamic`` re-splits the
pipeline in memory (``parallel.pp_balance_move=memory``; pure).

A rank's state for the move is named by global names: each parameter's (its local TP/EP
shard, its AdamW moments and step, and the DP option state filed under its name) and each
MoE layer's expert bias. A name a rank holds on both the old and the new split stays where
it is. A name it needs and did not hold comes from the rank with the same non-pipeline
coordinates (dp, cp, tp, so the same TP/EP shard and the same DP rank) whose old stage held
it, the lowest such stage when several did (the tied embedding's two copies). Every rank
computes the same list from the two splits and the layout, so no rank asks another what it
holds: each posts its sends and receives in the list's order (by name, then receiver), which
both ends of a pair share. A layer that moves past a neighbour goes straight to its new
stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hybrid.planning.models.moe import expert_bias_layers, expert_bias_name
from hybrid.planning.params import block_param_specs


@dataclass(frozen=True, order=True)
class Transfer:
    """The state of global name ``name`` goes from global rank ``src`` to ``dst``."""

    name: str
    src: int
    dst: int


def block_state_names(m, block_id: int, *, sequence_parallel: bool = False) -> frozenset[str]:
    """The names block ``block_id`` holds state under: its parameters and, for an MoE layer
    with aux-loss-free balancing, its expert bias (``hybrid.model.expert_bias``)."""
    names = {spec.name for spec in
             block_param_specs(m, block_id, sequence_parallel=sequence_parallel).values()}
    if expert_bias_layers(m, [block_id]):
        names.add(expert_bias_name(block_id))
    return frozenset(names)


def stage_state_names(block_names: Sequence[frozenset[str]],
                      ranges: Sequence[range]) -> list[frozenset[str]]:
    """Each stage's names: the union over its blocks (``block_names`` by block id)."""
    return [frozenset().union(*(block_names[b] for b in blocks)) for blocks in ranges]


def stage_transfers(layout, block_names: Sequence[frozenset[str]], old: Sequence[range],
                    new: Sequence[range]) -> list[Transfer]:
    """Every transfer of the job for a move from split ``old`` to ``new`` (each a range of
    blocks per stage, one stage per pipeline rank), sorted by (name, src, dst)."""
    if len(old) != layout.pp or len(new) != layout.pp:
        raise ValueError(f"a move needs one stage per pipeline rank: pp={layout.pp}, "
                         f"{len(old)} stages before and {len(new)} after")
    held = stage_state_names(block_names, old)
    needed = stage_state_names(block_names, new)
    out = []
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        stage = coords["pp"]
        for name in needed[stage] - held[stage]:
            source = min(s for s, names in enumerate(held) if name in names)
            out.append(Transfer(name, layout.rank(**{**coords, "pp": source}), rank))
    return sorted(out)


def rank_transfers(transfers: Sequence[Transfer], rank: int
                   ) -> tuple[list[Transfer], list[Transfer]]:
    """``rank``'s sends and receives of ``transfers``, in the order both ends post them."""
    return ([t for t in transfers if t.src == rank], [t for t in transfers if t.dst == rank])


def kept_names(block_names: Sequence[frozenset[str]], old: Sequence[range],
               new: Sequence[range], stage: int) -> frozenset[str]:
    """The names ``stage`` holds before and after the move: they stay in place."""
    return (stage_state_names(block_names, old)[stage]
            & stage_state_names(block_names, new)[stage])
