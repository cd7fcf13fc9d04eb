"""hybrid's llama with experts <-> HF ``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM``: the
names, the layouts, the config. ``hybrid.interop.llama_family`` hands this module a
``qwen2_moe`` or ``qwen3_moe`` config.json, and a model with experts that Mixtral cannot hold.

Qwen2-MoE is Llama with q/k/v biases (``qkv_bias``, on by default) whose MLPs are, layer by
layer, either a dense SwiGLU (``intermediate_size``) or a sparse block: a router ``gate``,
``num_experts`` SwiGLU experts of ``moe_intermediate_size``, softmax then top-k, renormalised
only with ``norm_topk_prob`` (Qwen2-MoE's default is not to), and a shared expert of
``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``. Qwen3-MoE is
the same without the shared expert and the biases, with Qwen3's per-head q/k norms. Layer
``i`` (from 0) is sparse when it is not in ``mlp_only_layers`` and ``(i + 1) %
decoder_sparse_step == 0``; hybrid's layer spec says the same with ``moe.every=1`` and
``moe.dense_layers`` (``hybrid.planning.models.layers``), and export writes back the largest
sparse step that fits with the rest in ``mlp_only_layers`` (the same layers).

Keys: per expert, as ``save_pretrained`` writes them (``mlp.experts.{e}.gate_proj.weight``,
``up_proj``, ``down_proj``), and that is what export writes; the fused names transformers 5's
modules hold (``mlp.experts.gate_up_proj [E, 2F, h]``, ``mlp.experts.down_proj [E, h, F]``) are
read too, as Mixtral's are (no test holds that path for Qwen).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid.interop import llama, mixtral
from hybrid.interop.hf_dir import ConversionError
from hybrid.interop.llama_variants import variant_fields
from hybrid.planning.models.layers import layer_spec

if TYPE_CHECKING:
    import torch

PER_EXPERT = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
SHARED = (("mlp.shared.gate", "mlp.shared_expert.gate_proj.weight"),
          ("mlp.shared.up", "mlp.shared_expert.up_proj.weight"),
          ("mlp.shared.down", "mlp.shared_expert.down_proj.weight"),
          ("mlp.shared_gate.weight", "mlp.shared_expert_gate.weight"))
ARCHITECTURES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
DEFAULT_AUX_LOSS = 0.001
"""transformers' default ``router_aux_loss_coef`` for both: what a config.json without it means."""


def model_type(model: Any) -> str:
    """The HF model_type holding ``model`` (with experts); ``ConversionError`` where none does."""
    if model.qk_norm:
        if model.moe.shared_ffn_hidden or model.qkv_bias:
            raise ConversionError("model.qk_norm with a shared expert or q/k/v biases has no HF "
                                  "model_type (Qwen3-MoE has neither); export with --format "
                                  "torch")
        return "qwen3_moe"
    if not model.moe.shared_ffn_hidden:
        raise ConversionError("experts with dense layers, moe.every > 1 or unnormalised top-k "
                              "but no shared expert and no q/k norms has no HF model_type "
                              "(Qwen2-MoE has a shared expert, Qwen3-MoE q/k norms); export "
                              "with --format torch")
    if model.sliding_window is not None:
        raise ConversionError("model.sliding_window with experts has no HF model_type here; "
                              "export with --format torch")
    return "qwen2_moe"


def _layer_pairs(model: Any, b: int) -> list[tuple[str, str]]:
    """(ours, theirs) of layer ``b``'s tensors that map one to one (not q/k/v, not experts)."""
    spec = layer_spec(model, b)
    block = list(llama.BLOCK[:3]) + (list(llama.HEAD_NORMS) if model.qk_norm else [])
    if not spec.moe:
        block += llama.BLOCK[3:]
    else:
        block.append(("mlp.router.weight", "mlp.gate.weight"))
        if spec.shared_ffn:
            block += SHARED
    return [(f"blocks.{b}.{ours}", f"model.layers.{b - 1}.{theirs}") for ours, theirs in block]


def _pairs(model: Any) -> list[tuple[str, str]]:
    pairs = list(llama.OUTSIDE)
    for b in range(1, model.layers + 1):
        pairs += _layer_pairs(model, b)
    return pairs if model.tie_embeddings else pairs + [(llama.HEAD, "lm_head.weight")]


def to_hf(weights: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """hybrid global weights -> HF Qwen2-MoE / Qwen3-MoE tensors, experts one by one (an
    all-zero expert bias is dropped, a nonzero one refused, as for Mixtral)."""
    model_type(model)
    weights = mixtral._without_expert_bias(weights)
    out = {}
    for ours, theirs in _pairs(model):
        tensor = llama._take(weights, ours, model)
        out[theirs] = tensor[:model.vocab] if ours in (llama.EMBEDDING, llama.HEAD) else tensor
    used = len(out)
    for b in range(1, model.layers + 1):
        hf, mine = f"model.layers.{b - 1}", f"blocks.{b}"
        for kind in llama._qkv_parts(model):
            fused = llama._take(weights, f"{mine}.attention.qkv.{kind}", model)
            for part, tensor in zip(llama.QKV, llama._split_qkv(fused, model)):
                out[f"{hf}.self_attn.{part}.{kind}"] = tensor
            used += 1
        if layer_spec(model, b).moe:
            for ours, theirs in PER_EXPERT:
                stacked = llama._take(weights, f"{mine}.mlp.experts.{ours}", model)
                for e in range(model.moe.experts):
                    out[f"{hf}.mlp.experts.{e}.{theirs}.weight"] = stacked[e]
            used += len(PER_EXPERT)
    llama._all_used(weights, used)
    return {name: t.detach().contiguous().clone() for name, t in out.items()}


def from_hf(tensors: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """HF Qwen2-MoE / Qwen3-MoE tensors (either expert layout) -> hybrid global weights."""
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
        for kind in llama._qkv_parts(model):
            parts = [take(f"{hf}.self_attn.{p}.{kind}") for p in llama.QKV]
            out[f"{mine}.attention.qkv.{kind}"] = llama._fuse_qkv(*parts, model)
        if layer_spec(model, b).moe:
            out.update(_experts_from_hf(hf, mine, tensors, take, model))
    mixtral._check_shapes(out, model)
    llama._all_used(tensors, len(taken))
    return {name: t.detach().contiguous().clone() for name, t in out.items()}


def _experts_from_hf(hf: str, mine: str, tensors: dict, take, model: Any) -> dict:
    """One layer's stacked experts, from the per-expert or the fused layout."""
    import torch

    if f"{hf}.mlp.experts.gate_up_proj" not in tensors:
        return {f"{mine}.mlp.experts.{ours}": torch.stack(
                    [take(f"{hf}.mlp.experts.{e}.{theirs}.weight") for e in range(model.moe.experts)])
                for ours, theirs in PER_EXPERT}
    gate_up = take(f"{hf}.mlp.experts.gate_up_proj")
    if gate_up.shape[1] != 2 * model.moe_ffn:
        raise ConversionError(f"{hf}.mlp.experts.gate_up_proj has shape {list(gate_up.shape)}, "
                              f"config.json implies [{model.moe.experts}, {2 * model.moe_ffn}, "
                              f"{model.hidden}]; the config and the weights disagree")
    gate, up = gate_up.split(model.moe_ffn, dim=1)
    return {f"{mine}.mlp.experts.gate": gate, f"{mine}.mlp.experts.up": up,
            f"{mine}.mlp.experts.down": take(f"{hf}.mlp.experts.down_proj")}


def sparse_step(model: Any) -> tuple[int, list[int]]:
    """(``decoder_sparse_step``, ``mlp_only_layers``) giving ``model``'s sparse layers: the
    largest step every sparse layer is a multiple of, the other multiples listed dense."""
    sparse = [b for b in range(1, model.layers + 1) if layer_spec(model, b).moe]
    step = max((s for s in range(1, model.layers + 1) if all(b % s == 0 for b in sparse)),
               default=1)
    dense = [b - 1 for b in range(step, model.layers + 1, step) if b not in sparse]
    return step, dense


def hf_config(model: Any, eod: int | None = None) -> dict:
    """``config.json`` of the HF Qwen2-MoE or Qwen3-MoE equal to ``model``."""
    kind = model_type(model)
    config = llama.dense_hf_config(model, eod)
    for key in ("mlp_bias", "pretraining_tp", "attention_bias"):
        config.pop(key)
    step, dense = sparse_step(model)
    config.update(
        architectures=[ARCHITECTURES[kind]], model_type=kind, use_sliding_window=False,
        sliding_window=None, max_window_layers=model.layers, num_experts=model.moe.experts,
        num_experts_per_tok=model.moe.topk, moe_intermediate_size=model.moe_ffn,
        norm_topk_prob=model.moe.norm_topk_prob, decoder_sparse_step=step,
        mlp_only_layers=dense, router_aux_loss_coef=model.moe.aux_loss,
        output_router_logits=False)
    if kind == "qwen2_moe":
        config.update(qkv_bias=model.qkv_bias,
                      shared_expert_intermediate_size=model.moe.shared_ffn_hidden)
    return config


def model_fields(config: dict, source: str) -> dict:
    """``ModelConfig`` fields of an HF ``qwen2_moe`` or ``qwen3_moe`` config.json;
    ``ConversionError`` naming the first setting hybrid cannot represent."""
    kind = config["model_type"]
    dense = {**config, "model_type": "qwen2" if kind == "qwen2_moe" else "qwen3"}
    if not config.get("use_sliding_window", False):
        dense["sliding_window"] = None  # transformers writes 0 or 4096 when it is off
    fields = variant_fields(dense, source)
    layers, step = config["num_hidden_layers"], config.get("decoder_sparse_step", 1)
    only = config.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise ConversionError(f"{source}: decoder_sparse_step={step!r} must be an integer >= 1")
    shared = config.get("shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
    if kind == "qwen2_moe" and not shared:
        raise ConversionError(f"{source}: shared_expert_intermediate_size={shared!r}: hybrid "
                              f"converts Qwen2-MoE with its shared expert (> 0)")
    return {**fields, "name": f"hf-{kind}", "qkv_bias": bool(config.get("qkv_bias", True))
            if kind == "qwen2_moe" else False,
            "moe": {"experts": config["num_experts" if "num_experts" in config else
                                      "num_local_experts"],  # Qwen3-MoE's may write the latter
                    "topk": config["num_experts_per_tok"],
                    "ffn_hidden": config["moe_intermediate_size"], "every": 1,
                    "dense_layers": [i + 1 for i in range(layers)
                                     if i in only or (i + 1) % step],
                    "shared_ffn_hidden": shared, "router": "softmax_topk",
                    "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
                    "aux_loss": mixtral.aux_loss_coefficient(config, source, DEFAULT_AUX_LOSS)}}
