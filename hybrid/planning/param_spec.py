"""``ParamSpec``, one parameter's identity whatever the layout, and the pieces a model family
builds its parameter table from (pure).

A family's spec (``hybrid.planning.models``) lists each block's parameters with these helpers:
a norm, a column- or row-parallel linear, a vocabulary matrix. ``hybrid.planning.params``
asks the family for the table; nothing here knows a family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"
TIED_HEAD_ALIAS = "word_embeddings_weight"
"""The head block's local name for the tied embedding matrix (its own copy on a last stage)."""


@dataclass(frozen=True)
class Placement:
    """Which role groups (``hybrid.planning.layout.ROLES``) a parameter's gradient, optimizer
    state and norm live on. Consumers ask the spec's placement, never a parameter's kind: a
    dense parameter and an expert's differ only here."""

    reduce_role: str = "gradient"
    """The ranks that average its gradient once per step (the DP mean)."""
    shard_role: str = "sharding"
    """The ranks a ZeRO stage shards its optimizer state (and gradient) over."""
    norm_role: str = "model"
    """The ranks that hold different parts of it (besides its TP split): its counted
    gradient's squares are summed over them for the global norm."""
    loss_role: Optional[str] = None
    """The ranks whose losses a rank's gradient of it sums (None: its own loss only). Every DP
    strategy takes a rank's gradient as its replica's: the mean over ``reduce_role`` of the
    replicas' gradients is then the 1-process mean. An expert's weights compute the tokens
    of their whole expert group (the all-to-all brings them, its backward returns their
    gradients), so ``GradSync`` divides an expert's gradient by that group's size as it
    arrives: ep replicas' losses summed, made one replica's."""


DENSE = Placement()
"""Every parameter of a dense model: reduced and sharded over dp x cp, split over tp x pp."""
EXPERT = Placement(reduce_role="expert_gradient", shard_role="expert_sharding",
                   norm_role="expert_model", loss_role="expert")
"""An expert's weights (``hybrid.planning.models.moe``): its own role groups on the expert grid
(``hybrid.planning.layout.EXPERT_AXES``), the dense ones' ranks at ``ep=1``."""
PLACEMENTS = (DENSE, EXPERT)
"""Every placement, in the fixed order the ranks reduce their norms in."""


@dataclass(frozen=True)
class ParamSpec:
    """What a parameter is, whatever the layout."""

    name: str
    """Global name (see ``hybrid.planning.params``)."""
    shape: tuple[int, ...]
    """Global shape: the 1-process model's (vocabulary padded)."""
    tp_dim: Optional[int] = None
    """The dimension split evenly over the TP group; None: every TP rank holds all of it."""
    weight_decay: bool = False
    """In AdamW's decayed group: matrices only (not norms, biases or the position table)."""
    real_rows: Optional[int] = None
    """For the vocabulary matrices: rows before padding (the rest are padding rows)."""
    sequence_partial: bool = False
    """TP-replicated, but its gradient is a partial sum over TP, summed there before the DP
    mean: under sequence parallelism each TP rank sees only its tokens (norms and row-parallel
    biases); an MoE router's gradient comes from each TP rank's partial expert outputs."""
    tied: bool = False
    """The embedding matrix shared with the head: a last pipeline stage holds a copy whose
    gradient is summed with the first stage's over the embedding group."""
    placement: Placement = DENSE
    """The role groups that reduce, shard and count it (``Placement``)."""
    ep_dim: Optional[int] = None
    """The dimension split evenly over the expert-parallel group (an expert's stacked weights:
    dim 0, the expert index); None: not split by expert parallelism."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_shape(self, tp: int, ep: int = 1) -> tuple[int, ...]:
        """The shape one TP rank (of one expert-parallel rank) holds."""
        shape = list(self.shape)
        for dim, parts, axis in ((self.tp_dim, tp, "tp"), (self.ep_dim, ep, "ep")):
            if dim is not None:
                assert shape[dim] % parts == 0, f"{self.name}: {axis}={parts} does not split " \
                                                f"{self.shape}"
                shape[dim] //= parts
        return tuple(shape)

    def local_offset(self, tp_rank: int, tp: int, ep_rank: int = 0, ep: int = 1
                     ) -> tuple[int, ...]:
        """Where the shard of TP rank ``tp_rank`` (and expert-parallel rank ``ep_rank``)
        starts in the global tensor."""
        offset = [0] * len(self.shape)
        local = self.local_shape(tp, ep)
        for dim, rank in ((self.tp_dim, tp_rank), (self.ep_dim, ep_rank)):
            if dim is not None:
                offset[dim] = rank * local[dim]
        return tuple(offset)


def replicated_spec(name: str, shape: tuple[int, ...]) -> ParamSpec:
    """The spec of a parameter of a plain module (not built by hybrid): replicated everywhere,
    decayed when it is a matrix."""
    return ParamSpec(name=name, shape=tuple(shape), weight_decay=len(shape) >= 2)


def norm_specs(prefix: str, h: int, sp: bool, parts=("weight", "bias")) -> dict[str, ParamSpec]:
    """A norm's ``parts`` (LayerNorm: weight and bias; RMSNorm: weight), TP-replicated."""
    return {f"{prefix}.{part}": ParamSpec(name="", shape=(h,), sequence_partial=sp)
            for part in parts}


def column_specs(prefix: str, out: int, inp: int, bias: bool = True) -> dict[str, ParamSpec]:
    """A column-parallel linear ``[out, inp]`` (and bias ``[out]``), split over TP on dim 0."""
    specs = {f"{prefix}.weight": ParamSpec(name="", shape=(out, inp), tp_dim=0,
                                           weight_decay=True)}
    if bias:
        specs[f"{prefix}.bias"] = ParamSpec(name="", shape=(out,), tp_dim=0)
    return specs


def row_specs(prefix: str, out: int, inp: int, sp: bool, bias: bool = True
              ) -> dict[str, ParamSpec]:
    """A row-parallel linear ``[out, inp]`` split over TP on dim 1; its bias replicated."""
    specs = {f"{prefix}.weight": ParamSpec(name="", shape=(out, inp), tp_dim=1,
                                           weight_decay=True)}
    if bias:
        specs[f"{prefix}.bias"] = ParamSpec(name="", shape=(out,), sequence_partial=sp)
    return specs


def vocab_matrix(padded_vocab: int, vocab: int, h: int, tied: bool) -> ParamSpec:
    """The embedding or output matrix ``[V, h]`` (V padded), split over TP by rows."""
    return ParamSpec(name="", shape=(padded_vocab, h), tp_dim=0, weight_decay=True,
                     real_rows=vocab, tied=tied)


def named(prefix: str, local: dict[str, ParamSpec]) -> dict[str, ParamSpec]:
    """``local`` with each spec's global name: ``prefix`` + its local name."""
    return {key: replace(spec, name=f"{prefix}{key}") for key, spec in local.items()}


def head_specs(norm: dict[str, ParamSpec], padded_vocab: int, vocab: int, h: int,
               tied: bool) -> dict[str, ParamSpec]:
    """The head block's table: the tied embedding's alias first (a module's own parameters
    come before its submodules'), the final norm, the untied output matrix last."""
    specs = {}
    if tied:
        specs[TIED_HEAD_ALIAS] = replace(vocab_matrix(padded_vocab, vocab, h, True),
                                         name=EMBEDDING_WEIGHT)
    specs.update(named("", norm))
    if not tied:
        specs["output_layer.weight"] = replace(vocab_matrix(padded_vocab, vocab, h, False),
                                               name="head.output_layer.weight")
    return specs
