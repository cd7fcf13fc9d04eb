"""One identity per parameter: its global name, global shape and how it is sharded (pure).

Every parameter of the GPT has one ``ParamSpec``, made here from the model config alone and
attached to the built ``torch`` parameter (``param.spec``) by ``hybrid.model.gpt``. Whatever
needs a fact about a parameter reads it from the spec: weight decay, gradient clipping, the
gradient sync's extra reductions, TP gathering, optimizer state, checkpoints and the cost model.
Nothing depends on positional module names (which change with pp, vpp and the partition) or on
substrings of names.

Global names, the same on every layout (``b`` is the block id: 1..L for transformer layers)::

    embedding.word_embeddings.weight      [V, h]   split over TP on dim 0 (V: padded vocab)
    embedding.position_embeddings         [s, h]   replicated
    blocks.{b}.input_norm.{weight,bias}   [h]      replicated
    blocks.{b}.attention.qkv.{weight,bias} [3h, h], [3h]  dim 0
    blocks.{b}.attention.proj.weight      [h, h]   dim 1;  .bias [h] replicated
    blocks.{b}.mlp_norm.{weight,bias}     [h]      replicated
    blocks.{b}.mlp.fc1.{weight,bias}      [f, h], [f]  dim 0
    blocks.{b}.mlp.fc2.weight             [h, f]   dim 1;  .bias [h] replicated
    final_norm.{weight,bias}              [h]      replicated
    head.output_layer.weight              [V, h]   dim 0 (untied only; tied, the head uses
                                                   embedding.word_embeddings.weight)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from hybrid.planning.config import ModelConfig

EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"
TIED_HEAD_ALIAS = "word_embeddings_weight"
"""The head block's local name for the tied embedding matrix (its own copy on a last stage)."""


@dataclass(frozen=True)
class ParamSpec:
    """What a parameter is, whatever the layout."""

    name: str
    """Global name (see the module doc)."""
    shape: tuple[int, ...]
    """Global shape: the 1-process model's (vocabulary padded)."""
    tp_dim: Optional[int] = None
    """The dimension split evenly over the TP group; None: every TP rank holds all of it."""
    weight_decay: bool = False
    """In AdamW's decayed group: matrices only (not norms, biases or the position table)."""
    real_rows: Optional[int] = None
    """For the vocabulary matrices: rows before padding (the rest are padding rows)."""
    sequence_partial: bool = False
    """TP-replicated, but under sequence parallelism each TP rank sees only its tokens, so its
    gradient is a partial sum over TP (norms and row-parallel biases)."""
    tied: bool = False
    """The embedding matrix shared with the head: a last pipeline stage holds a copy whose
    gradient is summed with the first stage's over the embedding group."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """The shape one TP rank holds."""
        if self.tp_dim is None:
            return self.shape
        shape = list(self.shape)
        assert shape[self.tp_dim] % tp == 0, f"{self.name}: tp={tp} does not split {shape}"
        shape[self.tp_dim] //= tp
        return tuple(shape)

    def local_offset(self, tp_rank: int, tp: int) -> tuple[int, ...]:
        """Where TP rank ``tp_rank``'s shard starts in the global tensor."""
        offset = [0] * len(self.shape)
        if self.tp_dim is not None:
            offset[self.tp_dim] = tp_rank * self.local_shape(tp)[self.tp_dim]
        return tuple(offset)


def replicated_spec(name: str, shape: tuple[int, ...]) -> ParamSpec:
    """The spec of a parameter of a plain module (not built by hybrid): replicated everywhere,
    decayed when it is a matrix."""
    return ParamSpec(name=name, shape=tuple(shape), weight_decay=len(shape) >= 2)


def _norm(prefix: str, h: int, sp: bool) -> dict[str, ParamSpec]:
    return {f"{prefix}.{part}": ParamSpec(name="", shape=(h,), sequence_partial=sp)
            for part in ("weight", "bias")}


def _column(prefix: str, out: int, inp: int) -> dict[str, ParamSpec]:
    return {f"{prefix}.weight": ParamSpec(name="", shape=(out, inp), tp_dim=0, weight_decay=True),
            f"{prefix}.bias": ParamSpec(name="", shape=(out,), tp_dim=0)}


def _row(prefix: str, out: int, inp: int, sp: bool) -> dict[str, ParamSpec]:
    return {f"{prefix}.weight": ParamSpec(name="", shape=(out, inp), tp_dim=1, weight_decay=True),
            f"{prefix}.bias": ParamSpec(name="", shape=(out,), sequence_partial=sp)}


def _vocab_matrix(m: ModelConfig, tied: bool) -> ParamSpec:
    return ParamSpec(name="", shape=(m.padded_vocab, m.hidden), tp_dim=0, weight_decay=True,
                     real_rows=m.vocab, tied=tied)


def _named(prefix: str, local: dict[str, ParamSpec]) -> dict[str, ParamSpec]:
    return {key: replace(spec, name=f"{prefix}{key}") for key, spec in local.items()}


def block_param_specs(m: ModelConfig, block_id: int, *,
                      sequence_parallel: bool = False) -> dict[str, ParamSpec]:
    """Block ``block_id``'s parameters: local name (as the block module names it) -> spec.

    Block 0 is the embedding, 1..L the transformer layers, L+1 the head (see
    ``hybrid.model.gpt``). ``sequence_parallel``: whether the model is built with it (tp > 1).
    """
    h, sp, last = m.hidden, sequence_parallel, m.layers + 1
    # In the order the block's named_parameters() yields them (a module's own parameters
    # before its submodules'): the gradient buckets, and so ZeRO's shards, follow it.
    if block_id == 0:
        position = ParamSpec(name="", shape=(m.seq_len, h))
        return _named("embedding.", {"position_embeddings": position,
                                     "word_embeddings.weight": _vocab_matrix(m, m.tie_embeddings)})
    if block_id == last:
        specs = {}
        if m.tie_embeddings:
            specs[TIED_HEAD_ALIAS] = replace(_vocab_matrix(m, True), name=EMBEDDING_WEIGHT)
        specs.update(_named("", _norm("final_norm", h, sp)))
        if not m.tie_embeddings:
            specs["output_layer.weight"] = replace(_vocab_matrix(m, False),
                                                   name="head.output_layer.weight")
        return specs
    if not 0 < block_id < last:
        raise ValueError(f"block_id={block_id} is outside 0..{last}")
    local = {**_norm("input_norm", h, sp), **_column("attention.qkv", 3 * h, h),
             **_row("attention.proj", h, h, sp), **_norm("mlp_norm", h, sp),
             **_column("mlp.fc1", m.ffn, h), **_row("mlp.fc2", h, m.ffn, sp)}
    return _named(f"blocks.{block_id}.", local)


def model_param_specs(m: ModelConfig, *, sequence_parallel: bool = False
                      ) -> dict[str, ParamSpec]:
    """Every parameter of the model once: global name -> spec, in model order."""
    specs: dict[str, ParamSpec] = {}
    for block_id in range(m.layers + 2):
        for spec in block_param_specs(m, block_id, sequence_parallel=sequence_parallel).values():
            specs.setdefault(spec.name, spec)
    return specs
