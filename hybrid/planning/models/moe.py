"""The mixture-of-experts MLP as a layer kind (pure side; the torch side is
``hybrid.model.moe``): its parameter table, FLOPs, activation bytes and shape rules, for the
family that uses it (Llama: ``hybrid.planning.models.llama``). See docs/moe.md.

Parameters of an MoE layer's MLP (``E`` experts, ``F`` = ``model.moe.ffn_hidden``)::

    mlp.router.weight   [E, h]      replicated over TP; its gradient is a partial sum over TP
                                    (each TP rank's expert outputs are partial sums), summed
                                    there before the DP mean (``sequence_partial``)
    mlp.experts.gate    [E, F, h]   every expert's gate, split over TP on dim 1
    mlp.experts.up      [E, F, h]   dim 1
    mlp.experts.down    [E, h, F]   dim 2

With a shared expert (``model.moe.shared_ffn_hidden`` = ``S`` > 0: Qwen2-MoE), also::

    mlp.shared.gate     [S, h]      the shared expert's SwiGLU, split over TP on dim 0
    mlp.shared.up       [S, h]      dim 0
    mlp.shared.down     [h, S]      dim 1
    mlp.shared_gate.weight [1, h]   its sigmoid gate, replicated; gradient partial over TP

The three expert tensors carry the ``EXPERT`` placement (``hybrid.planning.param_spec``) and
are split over the expert-parallel group on dim 0 (``ep_dim``: each rank of it holds
``E / ep`` whole experts, TP-split as above); the router is dense.
"""

from __future__ import annotations

import math

from hybrid.planning.layout import LayoutError
from hybrid.planning.models.checks import positive, tp_divides
from hybrid.planning.models.registry import BYTES
from hybrid.planning.param_spec import EXPERT, ParamSpec

ROUTERS = ("softmax_topk", "topk_softmax")
"""``model.moe.router``'s values."""
EXPERT_BIAS = "mlp.expert_bias"
"""An MoE layer's aux-loss-free expert bias (``model.moe.expert_bias_rate`` > 0), under the
layer: ``blocks.{b}.mlp.expert_bias``, ``[E]`` fp32. Not a parameter (no gradient, no
optimizer state): the trainer moves it after each step; checkpoints hold it by this name."""
BIAS_COUNT_BYTES = 8
"""One expert's routed slots in the bias update's all-reduce (int64)."""


def expert_bias_name(block_id: int) -> str:
    return f"blocks.{block_id}.{EXPERT_BIAS}"


def is_expert_bias(name: str) -> bool:
    """Whether global (or ``model.``-prefixed) name ``name`` is an expert bias."""
    return name.endswith("." + EXPERT_BIAS)


def expert_bias_layers(m, blocks) -> int:
    """How many of ``blocks`` are MoE layers with an expert bias (0 when it is off)."""
    if not (m.moe.experts and m.moe.expert_bias_rate > 0):
        return 0
    return sum(1 for b in blocks if 1 <= b <= m.layers and m.is_moe_layer(b))


def expert_bias_payload(m, blocks) -> int:
    """Bytes of the expert-bias update's one all-reduce per step on a rank holding
    ``blocks``: its bias layers' routed slots, ``E`` int64 each, summed over the ranks that see
    different tokens (dp x cp)."""
    return expert_bias_layers(m, blocks) * m.moe.experts * BIAS_COUNT_BYTES


def moe_mlp_specs(m, shared_ffn: int = 0) -> dict[str, ParamSpec]:
    """An MoE layer's MLP parameters, local names under the layer (``mlp.``...), with a
    shared expert of inner size ``shared_ffn`` when it is > 0 (the layer's spec says)."""
    e, f, h = m.moe.experts, m.moe_ffn, m.hidden
    specs = {
        "mlp.router.weight": ParamSpec(name="", shape=(e, h), weight_decay=True,
                                       sequence_partial=True),
        "mlp.experts.gate": ParamSpec(name="", shape=(e, f, h), tp_dim=1, weight_decay=True,
                                      placement=EXPERT, ep_dim=0),
        "mlp.experts.up": ParamSpec(name="", shape=(e, f, h), tp_dim=1, weight_decay=True,
                                    placement=EXPERT, ep_dim=0),
        "mlp.experts.down": ParamSpec(name="", shape=(e, h, f), tp_dim=2, weight_decay=True,
                                      placement=EXPERT, ep_dim=0),
    }
    if shared_ffn:
        specs.update({
            "mlp.shared.gate": ParamSpec(name="", shape=(shared_ffn, h), tp_dim=0,
                                         weight_decay=True),
            "mlp.shared.up": ParamSpec(name="", shape=(shared_ffn, h), tp_dim=0,
                                       weight_decay=True),
            "mlp.shared.down": ParamSpec(name="", shape=(h, shared_ffn), tp_dim=1,
                                         weight_decay=True),
            "mlp.shared_gate.weight": ParamSpec(name="", shape=(1, h), weight_decay=True,
                                         sequence_partial=True)})
    return specs


def moe_layers(m) -> int:
    """How many of the ``m.layers`` layers are MoE layers."""
    return sum(m.is_moe_layer(b) for b in range(1, m.layers + 1))


def moe_mlp_forward_flops(m, b: int, shared_ffn: int = 0) -> float:
    """An MoE MLP's forward over ``b`` sequences, dropless: the router ``2Eh`` per token and
    each token's ``topk`` experts' SwiGLU, ``6hF`` each (what token dropping saves is not
    counted), and a shared expert's SwiGLU ``6hS`` and gate ``2h``."""
    tokens, h = b * m.seq_len, m.hidden
    shared = 6 * h * shared_ffn + 2 * h if shared_ffn else 0
    return tokens * (2 * m.moe.experts * h + m.moe.topk * 6 * h * m.moe_ffn + shared)


def moe_mlp_activation_bytes(m, tokens: int, tp: int, precision: str,
                             shared_ffn: int = 0) -> int:
    """Bytes an MoE MLP keeps for backward over ``tokens`` tokens on one rank, an estimate
    (not checked against saved-tensor hooks as the dense layer is): the router's logits and
    probabilities (fp32), and for each of a token's ``topk`` expert slots its gathered input
    and the expert's gate, up, SiLU and product (``F/tp`` wide each), dropless; a shared
    expert's four ``S/tp``-wide tensors, its output and its gate's logit and sigmoid."""
    low, k = BYTES[precision], m.moe.topk
    router = 2 * 4 * tokens * m.moe.experts
    per_slot = m.hidden * low + 4 * m.moe_ffn // tp * low
    shared = tokens * (4 * shared_ffn // tp * low + m.hidden * low + 2 * 4) if shared_ffn \
        else 0
    return router + k * tokens * per_slot + shared


def check_moe_shape(m, tp: int, fits) -> None:
    """The MoE settings' rules, one ``LayoutError`` line each (``fits``: the family's valid
    TP sizes, for the fix)."""
    if m.moe.experts == 0:
        return
    positive("model.moe.experts", m.moe.experts)
    positive("model.moe.topk", m.moe.topk)
    positive("model.moe.every", m.moe.every)
    if m.moe.ffn_hidden is not None:
        positive("model.moe.ffn_hidden", m.moe.ffn_hidden)
    if m.moe.topk > m.moe.experts:
        raise LayoutError(f"model.moe.topk={m.moe.topk} exceeds model.moe.experts="
                          f"{m.moe.experts}; choose model.moe.topk in 1..{m.moe.experts}")
    factor = m.moe.capacity_factor
    if factor is not None and not (isinstance(factor, (int, float)) and math.isfinite(factor)
                                   and factor > 0):
        raise LayoutError(f"model.moe.capacity_factor={factor} must be a number > 0 (1.0: "
                          f"an even share per expert), or null for dropless routing")
    if not (isinstance(m.moe.aux_loss, (int, float)) and math.isfinite(m.moe.aux_loss)
            and m.moe.aux_loss >= 0):
        raise LayoutError(f"model.moe.aux_loss={m.moe.aux_loss} must be a number >= 0 "
                          f"(0: off; 0.01 is common)")
    rate = m.moe.expert_bias_rate
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate >= 0):
        raise LayoutError(f"model.moe.expert_bias_rate={rate} must be a number >= 0 (0: off; "
                          f"1e-3 is megatron's default)")
    if m.moe.router not in ROUTERS:
        raise LayoutError(f"model.moe.router={m.moe.router!r} is not one of "
                          f"{', '.join(ROUTERS)}")
    tp_divides(tp, "model.moe.ffn_hidden", m.moe_ffn, fits)
    check_layer_kinds(m, tp, fits)


def check_layer_kinds(m, tp: int, fits) -> None:
    """The dense-layer list, the shared expert and the renormalisation switch."""
    wrong = [b for b in m.moe.dense_layers
             if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= m.layers]
    if wrong:
        raise LayoutError(f"model.moe.dense_layers={list(m.moe.dense_layers)} holds {wrong[0]!r}"
                          f", not a layer; list layers in 1..{m.layers} (counted from 1)")
    shared = m.moe.shared_ffn_hidden
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise LayoutError(f"model.moe.shared_ffn_hidden={shared!r} must be an integer >= 0 "
                          f"(0: no shared expert)")
    if shared:
        tp_divides(tp, "model.moe.shared_ffn_hidden", shared, fits)
    if not m.moe.norm_topk_prob and m.moe.router != "softmax_topk":
        raise LayoutError(f"model.moe.norm_topk_prob=false needs model.moe.router=softmax_topk "
                          f"(model.moe.router={m.moe.router} always renormalises its top k)")
