"""Analytical parameter counts and a first memory estimate per rank (pure arithmetic).

Blocks follow the model's block list: block 0 = embedding (word + learned position),
blocks 1..L = transformer layers, block L+1 = head (final norm + output layer).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from hybrid.planning.config import ModelConfig
from hybrid.planning.params import EMBEDDING_WEIGHT, block_param_specs
from hybrid.planning.cost.state_bytes import StateBytes
from hybrid.planning.strategies import SHARDINGS

BYTES = {"fp32": 4, "bf16": 2}


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
    """One transformer layer's parameters, from the parameter specs."""
    return _split(block_param_specs(m, 1).values())


def block_params(m: ModelConfig, *, head_owns_embedding_copy: bool = False) -> list[BlockParams]:
    """Per-block parameters of the 1-process model, from the parameter specs (tied: the head
    owns no output matrix, unless ``head_owns_embedding_copy``, as on a last pipeline stage
    without the embedding). Cached by the model's fields: a layout search asks for the same
    model's blocks thousands of times."""
    key = tuple(vars(m).items())  # the fields, cheaply: they are plain values
    return list(_block_params(key, head_owns_embedding_copy))


@functools.lru_cache(maxsize=64)
def _block_params(model_key: tuple, head_owns_embedding_copy: bool) -> tuple[BlockParams, ...]:
    m = ModelConfig(**dict(model_key))
    head_specs = block_param_specs(m, m.layers + 1).values()
    if m.tie_embeddings and not head_owns_embedding_copy:
        head_specs = [spec for spec in head_specs if spec.name != EMBEDDING_WEIGHT]
    return tuple([_split(block_param_specs(m, 0).values())] + [layer_params(m)] * m.layers
                 + [_split(head_specs)])


def param_count(m: ModelConfig) -> int:
    """Exact parameter count of the 1-process model (padded vocabulary V).

    Against the standard formula 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)), which counts one V×h
    matrix and no final norm: formula + 2h when tied, + V·h more when untied.
    """
    return sum(b.total for b in block_params(m))


def activation_bytes_per_layer(m: ModelConfig, micro_batch: int, tp: int, sp: bool,
                               precision: str, recompute: str = "none", cp: int = 1) -> int:
    """Bytes one transformer layer keeps for backward per micro-batch, tensor by tensor as
    hybrid's layer keeps them (``tests/test_model_tp.py`` checks this against saved-tensor
    hooks, byte for byte). Unlike Korthikanti et al. 2022's eq. 2, no attention scores: the
    fused attention kernel keeps only a log-sum-exp per head and token, so selective recompute
    saves just that here (it pays off with an unfused attention).

    fp32: the residual stream twice (the two norms' inputs; sharded by sequence parallelism)
    and their statistics; the two normed inputs of the column-parallel matmuls, gathered to
    the full sequence; the QKV output, the attention output, the MLP's two ``ffn``-wide
    tensors (sharded by TP). bf16 autocast keeps the matmul inputs and outputs in bf16, plus a
    bf16 copy of the layer's matmul weights per micro-batch. Full recompute keeps the input.
    Context parallelism keeps the same per token, for this rank's ``seq_len / cp`` tokens (its
    attention, too, keeps only the output and a log-sum-exp: ``hybrid.model.context``)."""
    s, b, h = m.seq_len // cp, micro_batch, m.hidden
    seq_shard = tp if sp else 1
    stream = 4 * s * b * h // seq_shard
    if recompute == "full":
        return stream
    low = BYTES[precision]
    nbytes = 2 * stream + 2 * 2 * 4 * s * b // seq_shard  # + two norms' mean and rstd
    nbytes += 2 * s * b * h * low  # the normed inputs of QKV and fc1
    nbytes += (4 * h + 2 * m.ffn) * s * b // tp * low
    if recompute == "none" or cp > 1:  # context attention is never recomputed selectively
        nbytes += 4 * b * (m.heads // tp) * s  # the attention kernel's log-sum-exp
    if precision == "bf16":
        nbytes += 2 * (4 * h * h + 2 * h * m.ffn) // tp
    return nbytes


def head_activation_bytes(m: ModelConfig, micro_batch: int, tp: int, sp: bool,
                          precision: str, cp: int = 1) -> int:
    """What the head and loss keep per micro-batch: the final norm's input and statistics,
    the gathered normed input of the output layer, the cross entropy's fp32 softmax over this
    rank's vocabulary shard with its target mask and indices (and a bf16 copy of the output
    weight under autocast), for this rank's ``seq_len / cp`` tokens."""
    s, b, h = m.seq_len // cp, micro_batch, m.hidden
    seq_shard = tp if sp else 1
    low = BYTES[precision]
    nbytes = (4 * s * b * h + 2 * 4 * s * b) // seq_shard + s * b * h * low
    nbytes += 4 * s * b * m.padded_vocab // tp + s * b * (1 + 8)
    if precision == "bf16":
        nbytes += 2 * m.padded_vocab // tp * h
    return nbytes


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
    per_block = block_params(m, head_owns_embedding_copy=embedding_copy)
    params = sum(per_block[i].per_rank(tp) for chunk in chunks for i in chunk)
    layers = max((sum(1 for i in chunk if 1 <= i <= m.layers) for chunk in chunks), default=0)
    act = activation_bytes_per_layer(m, micro_batch, tp, sp, precision, m.recompute, cp)
    act *= layers * inflight
    if m.recompute == "full" and layers:
        act += activation_bytes_per_layer(m, micro_batch, tp, sp, precision, cp=cp)
    if any(m.layers + 1 in chunk for chunk in chunks):
        act += head_inflight * head_activation_bytes(m, micro_batch, tp, sp, precision, cp)
    if state is None:
        state = SHARDINGS[zero].closed_form_state(params, dp)
    return MemoryEstimate(params=params, param_bytes=state.param_bytes,
                          grad_bytes=state.grad_bytes, optimizer_bytes=state.optimizer_bytes,
                          activation_bytes=int(act), dp_state_bytes=state.dp_state_bytes)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
