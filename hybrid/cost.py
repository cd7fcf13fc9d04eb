"""Analytical parameter counts and a first memory estimate per rank (pure arithmetic).

Blocks follow the model's block list: block 0 = embedding (word + learned position),
blocks 1..L = transformer layers, block L+1 = head (final norm + output layer).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hybrid.config import ModelConfig
from hybrid.params import EMBEDDING_WEIGHT, block_param_specs

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
                               precision: str) -> float:
    """Activations one layer keeps for backward, per micro-batch (Korthikanti et al. 2022,
    eq. 2-4, no dropout masks: 34 -> 30 units of s·b·h with 16-bit values; doubled for fp32)."""
    s, b, h, a = m.seq_len, micro_batch, m.hidden, m.heads
    attention_scores = 5 * a * s / (h * tp)
    if sp:
        units = 30 / tp + attention_scores
    else:
        units = 10 + 20 / tp + attention_scores
    scale = BYTES[precision] / 2
    return s * b * h * units * scale


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


def estimate_memory(m: ModelConfig, chunks: list[list[int]], *, tp: int, dp: int, zero: int,
                    micro_batch: int, inflight: int, sp: bool, precision: str,
                    embedding_copy: bool = False) -> MemoryEstimate:
    """Bytes on one rank holding the blocks of ``chunks`` (one block list per virtual chunk):
    fp32 weights and gradients, AdamW's two fp32 moments (sharded over DP with ZeRO-1; bf16
    adds no master copy since weights stay fp32), and the activations of ``inflight``
    (chunk, micro-batch) pairs kept for backward, each holding one chunk's layers (the largest
    chunk, to stay on the safe side). With ``m.recompute`` a layer keeps only its input, plus
    one layer's full activations while it is recomputed."""
    per_block = block_params(m, head_owns_embedding_copy=embedding_copy)
    params = sum(per_block[i].per_rank(tp) for chunk in chunks for i in chunk)
    optimizer = 2 * 4 * params // (dp if zero >= 1 else 1)
    layers = max((sum(1 for i in chunk if 1 <= i <= m.layers) for chunk in chunks), default=0)
    full_layer = activation_bytes_per_layer(m, micro_batch, tp, sp, precision)
    if m.recompute:
        layer_input = m.seq_len * micro_batch * m.hidden * BYTES[precision] / (tp if sp else 1)
        act = layer_input * layers * inflight + (full_layer if layers else 0)
    else:
        act = full_layer * layers * inflight
    return MemoryEstimate(params=params, param_bytes=4 * params, grad_bytes=4 * params,
                          optimizer_bytes=optimizer, activation_bytes=int(act))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
