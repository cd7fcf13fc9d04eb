"""Analytical parameter counts and a first memory estimate per rank (pure arithmetic).

Blocks follow the model's block list: block 0 = embedding, blocks 1..L = transformer layers,
block L+1 = head (final norm + output layer); what each holds and keeps is its family's
(``hybrid.planning.models``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

from hybrid.planning.config import ModelConfig
from hybrid.planning.models import BYTES, model_spec
from hybrid.planning.params import EMBEDDING_WEIGHT, block_param_specs
from hybrid.planning.cost.state_bytes import StateBytes
from hybrid.planning.strategies import SHARDINGS

@dataclass(frozen=True)
class BlockParams:
    """Parameters of one block, split into TP-sharded and TP-replicated parts."""

    sharded: int
    replicated: int

    @property
    def total(self) -> int:
        return self.sharded + self.replicated

    def per_rank(self, tp: int) -> int:
        return self.sharded // tp + self.replicated


def _split(specs) -> BlockParams:
    sharded = sum(spec.numel for spec in specs if spec.tp_dim is not None)
    replicated = sum(spec.numel for spec in specs if spec.tp_dim is None)
    return BlockParams(sharded, replicated)


def layer_params(m: ModelConfig) -> BlockParams:
    """The first transformer layer's parameters, from the parameter specs (with experts
    every ``moe.every``-th layer is an MoE layer: ``block_params`` has each)."""
    return _split(block_param_specs(m, 1).values())


def block_params(m: ModelConfig, *, head_owns_embedding_copy: bool = False) -> list[BlockParams]:
    """Per-block parameters of the 1-process model, from the parameter specs (tied: the head
    owns no output matrix, unless ``head_owns_embedding_copy``, as on a last pipeline stage
    without the embedding). Cached by the model's fields: a layout search asks for the same
    model's blocks thousands of times."""
    key = m.cache_key()  # the fields, cheaply: they are plain values
    return list(_block_params(key, head_owns_embedding_copy))


@functools.lru_cache(maxsize=64)
def _block_params(model_key: tuple, head_owns_embedding_copy: bool) -> tuple[BlockParams, ...]:
    m = ModelConfig(**dict(model_key))
    head_specs = block_param_specs(m, m.layers + 1).values()
    if m.tie_embeddings and not head_owns_embedding_copy:
        head_specs = [spec for spec in head_specs if spec.name != EMBEDDING_WEIGHT]
    layers = [_split(block_param_specs(m, b).values()) for b in range(1, m.layers + 1)]
    return tuple([_split(block_param_specs(m, 0).values())] + layers + [_split(head_specs)])


def param_count(m: ModelConfig) -> int:
    """Exact parameter count of the 1-process model (padded vocabulary V).

    Against the standard formula 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)), which counts one V×h
    matrix and no final norm: formula + 2h when tied, + V·h more when untied.
    """
    return sum(b.total for b in block_params(m))


def published_param_count(m: ModelConfig) -> int:
    """The model's own parameters, as a checkpoint of it counts them: the rows that pad the
    vocabulary for tensor parallelism (``model.vocab_pad_multiple``) are hybrid's, not the
    model's (smollm-360m's 640 adds 128 rows to SmolLM-360M's 49152)."""
    return param_count(replace(m, vocab_pad_multiple=1))


def activation_bytes_per_layer(m: ModelConfig, micro_batch: int, tp: int, sp: bool,
                               precision: str, recompute: str = "none", cp: int = 1) -> int:
    """Bytes one transformer layer keeps for backward per micro-batch on one rank, as its
    family counts them (GPT-2's: ``hybrid.planning.models.gpt2``)."""
    return model_spec(m).layer_activation_bytes(m, micro_batch, tp, sp, precision, recompute,
                                                cp)


def head_activation_bytes(m: ModelConfig, micro_batch: int, tp: int, sp: bool,
                          precision: str, cp: int = 1) -> int:
    """What the head and loss keep per micro-batch on one rank, as the family counts it."""
    return model_spec(m).head_activation_bytes(m, micro_batch, tp, sp, precision, cp)


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    dp_state_bytes: int = 0
    """What a DP option keeps besides (PowerSGD's error feedback, a delayed mean)."""
    gathered_bytes: int = 0
    """ZeRO-3: the most whole weights gathered at once during a step (besides the shards)."""

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + \
            self.activation_bytes + self.dp_state_bytes + self.gathered_bytes


def estimate_memory(m: ModelConfig, chunks: list[list[int]], *, tp: int, dp: int, zero: int,
                    micro_batch: int, inflight: int, sp: bool, precision: str, cp: int = 1,
                    embedding_copy: bool = False, head_inflight: int = 1,
                    state: Optional[StateBytes] = None) -> MemoryEstimate:
    """Bytes on one rank holding the blocks of ``chunks`` (one block list per virtual chunk):
    fp32 weights and gradients (sharded over DP, ``dp`` being dp x cp, with ZeRO-2), AdamW's two fp32 moments
    (sharded over DP with ZeRO-1 and 2; bf16
    adds no master copy since weights stay fp32), and the activations of ``inflight``
    (chunk, micro-batch) pairs kept for backward, each holding one chunk's layers (the largest
    chunk, to stay on the safe side), plus the head's for ``head_inflight`` micro-batches on
    the rank that holds it. Full recompute keeps each layer's input, plus one layer's
    activations while it is recomputed. ``state``: the exact bytes of weights, gradients and
    optimizer state (``hybrid.planning.cost.state_bytes``), else the closed form without bucket padding
    and AdamW's step counts."""
    return estimate_memories(m, chunks, tp=tp, dp=dp, zero=zero, micro_batch=micro_batch,
                             inflights=(inflight,), sp=sp, precision=precision, cp=cp,
                             embedding_copy=embedding_copy, head_inflight=head_inflight,
                             state=state)[0]


def estimate_memories(m: ModelConfig, chunks: list[list[int]], *, tp: int, dp: int, zero: int,
                      micro_batch: int, inflights: tuple[int, ...], sp: bool, precision: str,
                      cp: int = 1, embedding_copy: bool = False, head_inflight: int = 1,
                      state: Optional[StateBytes] = None) -> list[MemoryEstimate]:
    """``estimate_memory`` for each of ``inflights`` (the same blocks with as many
    micro-batches in flight), the rest computed once: 1F1B's ranks hold alike blocks with
    ``pp - r`` micro-batches in flight, and a search plans layouts of 128 ranks."""
    per_block = block_params(m, head_owns_embedding_copy=embedding_copy)
    params = sum(per_block[i].per_rank(tp) for chunk in chunks for i in chunk)
    layers = max((sum(1 for i in chunk if 1 <= i <= m.layers) for chunk in chunks), default=0)
    args = (micro_batch, tp, sp, precision)
    chunk_bytes = _chunk_activation_bytes(m, chunks, layers, args, m.recompute, cp)
    extra = 0  # added after the in-flight layers, in this order, as ever
    if m.recompute == "full" and layers:
        extra = max(_layer_bytes(m, chunks, args, "none", cp))
    head = None
    if any(m.layers + 1 in chunk for chunk in chunks):
        head = head_inflight * head_activation_bytes(m, micro_batch, tp, sp, precision, cp)
    if state is None:
        state = SHARDINGS[zero].closed_form_state(params, dp)
    out = []
    for inflight in inflights:
        act = chunk_bytes * inflight
        if extra:
            act += extra
        if head is not None:
            act += head
        out.append(MemoryEstimate(
            params=params, param_bytes=state.param_bytes, grad_bytes=state.grad_bytes,
            optimizer_bytes=state.optimizer_bytes, activation_bytes=int(act),
            dp_state_bytes=state.dp_state_bytes))
    return out


def _layer_bytes(m: ModelConfig, chunks: list[list[int]], args: tuple, recompute: str,
                 cp: int) -> list[int]:
    """Each of ``chunks``' layers' activation bytes, its kind's (``models.layers``)."""
    spec = model_spec(m)
    return [spec.block_activation_bytes(m, i, *args, recompute, cp)
            for chunk in chunks for i in chunk if 1 <= i <= m.layers]


def _chunk_activation_bytes(m: ModelConfig, chunks: list[list[int]], layers: int,
                            args: tuple, recompute: str, cp: int) -> int:
    """What one (chunk, micro-batch) pair keeps: the largest chunk's layers' bytes (a dense
    model's layers are alike: ``layers`` times one layer's; with MoE layers each counts its
    kind's)."""
    if not m.moe.experts:
        return activation_bytes_per_layer(m, *args, recompute, cp) * layers
    spec = model_spec(m)
    return max((sum(spec.block_activation_bytes(m, i, *args, recompute, cp)
                    for i in chunk if 1 <= i <= m.layers) for chunk in chunks), default=0)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
