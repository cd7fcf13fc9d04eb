"""The mixture-of-experts settings (``model.moe.*``): one keyword-only dataclass, the ``moe``
field of ``ModelConfig``. ``experts=0`` (the default) is a dense model, so a dense preset of
``conf/model`` lists none of these; an MoE preset lists a ``moe:`` block (docs/moe.md).

The flat keys of before (``model.experts``, ``model.moe_aux_loss``, ...) stay: ``FLAT_KEYS``
names, once, where each now lives; ``ModelConfig`` takes them as arguments and attributes
(``hybrid.planning.moved_keys``), a saved config or checkpoint manifest in the flat form loads
(``nest_model``), and hybrid's commands rewrite them on the command line
(``launch.commands.app.new_overrides``). Pure: no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional

from hybrid.planning import moved_keys


@dataclass(kw_only=True)
class MoEConfig:
    experts: int = 0
    """Routed experts per MoE layer (family llama; docs/moe.md), whose sparse MLP replaces the
    SwiGLU MLP (megatron's num_moe_experts, HF's num_local_experts / num_experts); 0 = a dense
    model."""
    topk: int = 2
    """Experts each token is routed to (experts > 0; megatron's moe_router_topk, HF's
    num_experts_per_tok)."""
    ffn_hidden: Optional[int] = None
    """One expert's SwiGLU inner size (megatron's moe_ffn_hidden_size, HF's
    moe_intermediate_size); None means model.ffn_hidden."""
    every: int = 1
    """Every this many layers is an MoE layer, starting with the first (megatron's
    moe_layer_freq, HF's decoder_sparse_step); the others keep the dense MLP."""
    dense_layers: List[int] = field(default_factory=list)
    """Layers (1..layers) that keep the dense MLP though ``every`` would make them MoE layers
    (HF's mlp_only_layers, counted from 1; DeepSeek's first_k_dense_replace=k is [1..k])."""
    shared_ffn_hidden: int = 0
    """A shared expert in every MoE layer: a SwiGLU of this inner size that every token goes
    through, its output scaled by a sigmoid gate (Qwen2-MoE's shared_expert_intermediate_size
    and shared_expert_gate; megatron's moe_shared_expert_intermediate_size); 0 = none."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' router probabilities to sum to 1 (Mixtral; HF's
    norm_topk_prob); false: each expert's weight is its softmax probability over all experts
    (Qwen2-MoE). Only with router=softmax_topk."""
    aux_loss: float = 0.0
    """Coefficient of the Switch/GShard load-balancing loss added to each MoE layer's
    gradient (megatron's moe_aux_loss_coeff, HF's router_aux_loss_coef; 0 = off; 0.01 is
    common)."""
    capacity_factor: Optional[float] = None
    """None: dropless (every routed token is computed). A number > 0: each expert takes at
    most ceil(factor * tokens * topk / experts) of a micro-batch's tokens, in token order,
    and drops the rest (megatron's moe_expert_capacity_factor)."""
    expert_bias_rate: float = 0.0
    """Auxiliary-loss-free load balancing (DeepSeek-V3; megatron's
    moe_router_bias_update_rate): each MoE layer keeps a per-expert bias, added to the router's
    probabilities only to choose the top-k, and after every optimizer step moved by this rate
    toward an even load (sign of the mean load minus each expert's, over the whole global
    batch). 0 = off (no bias); 1e-3 is megatron's default."""
    router: str = "softmax_topk"
    """softmax_topk (Mixtral: softmax over the experts, top-k, renormalised) | topk_softmax
    (top-k of the logits, softmax over those k: megatron's default; the same weights in exact
    arithmetic)."""


SECTION = "moe"

FLAT_KEYS = {
    "experts": "experts", "experts_topk": "topk", "moe_ffn_hidden": "ffn_hidden",
    "moe_every": "every", "moe_dense_layers": "dense_layers",
    "moe_shared_ffn_hidden": "shared_ffn_hidden", "moe_norm_topk_prob": "norm_topk_prob",
    "moe_aux_loss": "aux_loss", "moe_capacity_factor": "capacity_factor",
    "moe_expert_bias_rate": "expert_bias_rate", "moe_router": "router",
}
"""``model.<flat key>`` -> where it lives under ``model.moe``."""


def new_key(flat: str) -> str:
    """``experts_topk`` -> ``moe.topk`` (relative to ``model``)."""
    return f"{SECTION}.{FLAT_KEYS[flat]}"


flat_keys = moved_keys.flat_keys(SECTION, FLAT_KEYS)
"""Give ``ModelConfig`` the flat MoE keys (attributes read and written through to
``moe``, arguments of ``__init__``)."""


def nest_model(saved: Mapping[str, Any]) -> dict:
    """A saved ``model`` section (a run's config.json, a checkpoint manifest's config) in the
    nested form, whether it was written flat (before ``model.moe``) or nested."""
    moe = saved.get(SECTION)
    if isinstance(moe, MoEConfig):  # a ModelConfig's vars, not yet JSON
        saved = {**saved, SECTION: dataclasses.asdict(moe)}
    return moved_keys.nest(saved, SECTION, FLAT_KEYS)


def as_moe_config(value: Any) -> MoEConfig:
    """``ModelConfig.moe`` from what may stand for it: a ``MoEConfig``, a dict (a saved
    config's), or ``ModelConfig.cache_key``'s tuple of pairs (lists made tuples)."""
    if isinstance(value, MoEConfig):
        return value
    fields = dict(value.items() if isinstance(value, Mapping) else value)
    if isinstance(fields.get("dense_layers"), tuple):
        fields["dense_layers"] = list(fields["dense_layers"])
    return MoEConfig(**fields)
