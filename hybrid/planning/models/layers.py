"""Layers as specs (pure): a model's transformer layers are a list of per-layer kinds derived
from its ``ModelConfig``, and everything that differs between layers reads that list: the
blocks the model builds (``hybrid.model.llama``), each layer's parameters, FLOPs and
activation bytes (``hybrid.planning.models``), and so the partitioner's per-block costs.

Two kinds today: attention plus a dense MLP, or attention plus an MoE MLP (routed experts and,
with ``model.moe.shared_ffn_hidden`` > 0, a shared expert that every token goes through,
scaled by a sigmoid gate: Qwen2-MoE). Which layers are MoE: with ``model.moe.experts`` > 0, the
first layer and every ``moe.every``-th after it (megatron's ``moe_layer_freq``), except those
listed in ``model.moe.dense_layers`` (HF's ``mlp_only_layers``, counted from 1 here; a
DeepSeek-style ``first_k_dense_replace=k`` is ``[1, ..., k]``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSpec:
    """One transformer layer's kind."""

    moe: bool = False
    """An MoE MLP (router and routed experts) instead of the dense SwiGLU."""
    shared_ffn: int = 0
    """In an MoE layer, the shared expert's SwiGLU inner size; 0: no shared expert."""

    @property
    def kind(self) -> str:
        """``dense``, ``moe`` or ``moe+shared``: what a plan prints per layer."""
        if not self.moe:
            return "dense"
        return "moe+shared" if self.shared_ffn else "moe"


DENSE = LayerSpec()


def layer_spec(m, block_id: int) -> LayerSpec:
    """The kind of layer ``block_id`` (1..``m.layers``) of model config ``m``: the one rule
    that says which layers are MoE layers."""
    moe = getattr(m, "moe", None)
    if moe is None or not moe.experts or block_id in (moe.dense_layers or ()):
        return DENSE
    if (block_id - 1) % moe.every:
        return DENSE
    return LayerSpec(moe=True, shared_ffn=moe.shared_ffn_hidden or 0)


def layer_specs(m) -> list[LayerSpec]:
    """Every layer's kind, layer 1 first."""
    return [layer_spec(m, b) for b in range(1, m.layers + 1)]


def layer_kinds(m) -> dict[LayerSpec, int]:
    """How many layers of each kind, in order of first appearance: what the counts that are
    the same for alike layers (FLOPs, activation bytes) are computed once per."""
    moe = getattr(m, "moe", None)
    if moe is None or not moe.experts:  # a dense model: asked thousands of times in a search
        return {DENSE: m.layers} if m.layers else {}
    counts: dict[LayerSpec, int] = {}
    for spec in layer_specs(m):
        counts[spec] = counts.get(spec, 0) + 1
    return counts
