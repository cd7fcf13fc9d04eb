"""hybrid's llama with experts <-> HF ``MixtralForCausalLM``: the names, the layouts, the
config. ``hybrid.interop.llama_family`` hands a model with ``experts > 0`` (or a ``mixtral``
config.json) to this module.

Mixtral is Llama with a sparse MLP in every layer (``moe.every=1``): a router ``gate`` and
``num_local_experts`` SwiGLU experts, softmax then top-k renormalised (hybrid's
``moe.router=softmax_topk``), dropless. Two key layouts hold the experts, and both are read:

- per expert, as published Mixtral checkpoints and ``save_pretrained`` of transformers 5 write
  them: ``model.layers.{i}.block_sparse_moe.gate.weight [E, h]`` and
  ``block_sparse_moe.experts.{e}.w1/w3.weight [F, h]`` (gate, up), ``w2.weight [h, F]`` (down);
- fused, as transformers 5's modules hold them: ``model.layers.{i}.mlp.gate.weight``,
  ``mlp.experts.gate_up_proj [E, 2F, h]`` (gate rows, then up rows) and
  ``mlp.experts.down_proj [E, h, F]``.

Export writes the per-expert layout. The attention, norms, embedding and head are Llama's
(``hybrid.interop.llama``); every tensor of either side must be used.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from hybrid.interop import llama
from hybrid.interop.hf_dir import ConversionError
from hybrid.planning.models.moe import is_expert_bias

if TYPE_CHECKING:
    import torch

ATTENTION = llama.BLOCK[:3]
"""The (hybrid, HF) names of a layer's norms and attention output, as Llama's."""
PER_EXPERT = (("gate", "w1"), ("up", "w3"), ("down", "w2"))
MIXTRAL_DEFAULT_AUX_LOSS = 0.001
"""transformers' ``MixtralConfig`` default for ``router_aux_loss_coef``: what a config.json
without the key means."""


def _pairs(model: Any) -> list[tuple[str, str]]:
    pairs = list(llama.OUTSIDE)
    for b in range(1, model.layers + 1):
        pairs += [(f"blocks.{b}.{ours}", f"model.layers.{b - 1}.{theirs}")
                  for ours, theirs in ATTENTION]
    return pairs if model.tie_embeddings else pairs + [(llama.HEAD, "lm_head.weight")]


def beyond_mixtral(model: Any) -> bool:
    """Whether ``model`` (with experts) has what Mixtral has no place for, which Qwen-MoE
    holds (``hybrid.interop.qwen_moe``): dense layers listed, a shared expert, unnormalised
    top-k, q/k biases or norms."""
    return bool(model.moe.dense_layers or model.moe.shared_ffn_hidden
                or not model.moe.norm_topk_prob or model.qkv_bias or model.qk_norm)


def check_exportable(model: Any) -> None:
    if model.moe.every != 1:
        raise ConversionError(f"model.moe.every={model.moe.every}: Mixtral has a sparse MLP in "
                              f"every layer; only model.moe.every=1 exports")


def _without_expert_bias(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` less the aux-loss-free expert biases (``model.moe.expert_bias_rate``),
    which must be zero: HF Mixtral's router has no bias, and dropping a nonzero one would
    export a model that routes its tokens otherwise than the one trained (no error would say
    so, and its outputs would differ), so that export is refused instead."""
    biases = {name: t for name, t in weights.items() if is_expert_bias(name)}
    moved = {name: t for name, t in biases.items() if bool(t.abs().max() > 0)}
    if moved:
        name = next(iter(moved))
        raise ConversionError(
            f"{name} is nonzero (max |bias| {float(moved[name].abs().max()):.3g}, "
            f"{len(moved)} MoE layers): the model routes with the aux-loss-free expert bias "
            f"(model.moe.expert_bias_rate), which HF Mixtral's router has no place for, so "
            f"the export would route differently; export it with --format torch instead")
    return {name: t for name, t in weights.items() if name not in biases}


def to_hf(weights: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """hybrid global weights -> HF Mixtral tensors, experts one by one (an all-zero expert
    bias is dropped, a nonzero one refused: ``_without_expert_bias``)."""
    check_exportable(model)
    weights = _without_expert_bias(weights)
    out = {}
    for ours, theirs in _pairs(model):
        tensor = llama._take(weights, ours, model)
        out[theirs] = tensor[:model.vocab] if ours in (llama.EMBEDDING, llama.HEAD) else tensor
    used = len(out)
    for b in range(1, model.layers + 1):
        hf, mine = f"model.layers.{b - 1}", f"blocks.{b}"
        fused = llama._take(weights, f"{mine}.attention.qkv.weight", model)
        for part, tensor in zip(llama.QKV, llama._split_qkv(fused, model)):
            out[f"{hf}.self_attn.{part}.weight"] = tensor
        out[f"{hf}.block_sparse_moe.gate.weight"] = llama._take(
            weights, f"{mine}.mlp.router.weight", model)
        for ours, theirs in PER_EXPERT:
            stacked = llama._take(weights, f"{mine}.mlp.experts.{ours}", model)
            for e in range(model.moe.experts):
                out[f"{hf}.block_sparse_moe.experts.{e}.{theirs}.weight"] = stacked[e]
        used += 5
    llama._all_used(weights, used)
    return {name: t.detach().contiguous().clone() for name, t in out.items()}


def from_hf(tensors: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """HF Mixtral tensors (either layout) -> hybrid global weights."""
    import torch

    tensors = {k: v for k, v in tensors.items() if not k.endswith(llama.IGNORED)}
    if model.tie_embeddings and "lm_head.weight" in tensors:
        if not torch.equal(tensors.pop("lm_head.weight"), tensors[llama.OUTSIDE[0][1]]):
            raise ConversionError("tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight; set tie_word_embeddings=false")
    taken: set[str] = set()

    def take(name: str):
        taken.add(name)
        return llama._take(tensors, name, model)

    out = {ours: take(theirs) for ours, theirs in _pairs(model)}
    for b in range(1, model.layers + 1):
        hf, mine = f"model.layers.{b - 1}", f"blocks.{b}"
        parts = [take(f"{hf}.self_attn.{p}.weight") for p in llama.QKV]
        out[f"{mine}.attention.qkv.weight"] = llama._fuse_qkv(*parts, model)
        out.update(_experts_from_hf(hf, mine, tensors, take, model))
    _check_shapes(out, model)
    llama._all_used(tensors, len(taken))
    return {name: t.detach().contiguous().clone() for name, t in out.items()}


def _experts_from_hf(hf: str, mine: str, tensors: dict, take, model: Any) -> dict:
    """One layer's router and stacked experts, from the per-expert or the fused layout."""
    import torch

    if f"{hf}.block_sparse_moe.gate.weight" in tensors:
        moe = f"{hf}.block_sparse_moe"
        out = {f"{mine}.mlp.router.weight": take(f"{moe}.gate.weight")}
        for ours, theirs in PER_EXPERT:
            out[f"{mine}.mlp.experts.{ours}"] = torch.stack(
                [take(f"{moe}.experts.{e}.{theirs}.weight") for e in range(model.moe.experts)])
        return out
    gate_up = take(f"{hf}.mlp.experts.gate_up_proj")
    if gate_up.shape[1] != 2 * model.moe_ffn:
        raise ConversionError(f"{hf}.mlp.experts.gate_up_proj has shape {list(gate_up.shape)}, "
                              f"config.json implies [{model.moe.experts}, {2 * model.moe_ffn}, "
                              f"{model.hidden}]; the config and the weights disagree")
    gate, up = gate_up.split(model.moe_ffn, dim=1)
    return {f"{mine}.mlp.router.weight": take(f"{hf}.mlp.gate.weight"),
            f"{mine}.mlp.experts.gate": gate, f"{mine}.mlp.experts.up": up,
            f"{mine}.mlp.experts.down": take(f"{hf}.mlp.experts.down_proj")}


def _check_shapes(weights: dict, model: Any) -> None:
    """Every converted tensor has its parameter spec's shape (the vocabulary unpadded), so a
    config that disagrees with the weights is named at import, not after launch."""
    from hybrid.planning.params import model_param_specs

    for name, spec in model_param_specs(model).items():
        shape = tuple(spec.shape)
        if name in (llama.EMBEDDING, llama.HEAD):
            shape = (model.vocab, *shape[1:])
        if name in weights and tuple(weights[name].shape) != shape:
            raise ConversionError(
                f"{name} (from HF) has shape {list(weights[name].shape)}, config.json implies "
                f"{list(shape)} (hidden_size={model.hidden}, intermediate_size="
                f"{model.moe_ffn}, num_local_experts={model.moe.experts}, num_key_value_heads="
                f"{model.kv}); the config and the weights disagree: use the config.json saved "
                f"with these weights")


def hf_config(model: Any, eod: int | None = None) -> dict:
    """``config.json`` of the HF Mixtral equal to ``model``."""
    check_exportable(model)
    config = llama.dense_hf_config(model, eod)
    config.pop("mlp_bias"), config.pop("attention_bias"), config.pop("pretraining_tp")
    return {**config, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": model.moe_ffn, "num_local_experts": model.moe.experts,
            "num_experts_per_tok": model.moe.topk, "router_jitter_noise": 0.0,
            "router_aux_loss_coef": model.moe.aux_loss, "output_router_logits": False,
            "sliding_window": None}


def model_fields(config: dict, source: str) -> dict:
    """``ModelConfig`` fields of an HF Mixtral ``config.json``; ``ConversionError`` naming
    the first setting hybrid cannot represent."""
    jitter = config.get("router_jitter_noise", 0.0)
    if jitter:
        raise ConversionError(f"{source}: router_jitter_noise={jitter} cannot be converted: "
                              f"hybrid's router adds no noise")
    if config.get("head_dim") is None:
        config = {**config, "head_dim": config["hidden_size"] // config["num_attention_heads"]}
    fields = llama.model_fields(config, source)  # the dense part
    return {**fields, "name": "hf-mixtral",
            "moe": {"experts": config["num_local_experts"],
                    "topk": config["num_experts_per_tok"],
                    "ffn_hidden": config["intermediate_size"], "every": 1,
                    "router": "softmax_topk", "aux_loss": aux_loss_coefficient(config, source)}}


def aux_loss_coefficient(config: dict, source: str,
                         default: float = MIXTRAL_DEFAULT_AUX_LOSS) -> float:
    """``router_aux_loss_coef`` as ``model.moe.aux_loss`` (HF's ``default`` when absent), so
    that an import then an export writes the coefficient it read."""
    value = config.get("router_aux_loss_coef", default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ConversionError(f"{source}: router_aux_loss_coef={value!r} must be a finite "
                              f"number >= 0 (0: no load-balancing loss); fix config.json")
    return float(value)
