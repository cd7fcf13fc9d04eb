"""hybrid's llama <-> HF ``LlamaForCausalLM``: the names, the layouts and the config.

hybrid's llama is HF Llama's architecture (pre-RMSNorm, SwiGLU, rotary positions in HF's
``rotate_half`` convention, grouped-query attention, no biases), so the conversion is a
renaming plus two re-layouts:

- the fused QKV: hybrid's rows are per key/value group ``(group, its query heads | key |
  value, head_dim)`` (Megatron's), HF's are three matrices ``q_proj``, ``k_proj``, ``v_proj``;
- the vocabulary: hybrid pads it, HF has none (as for GPT-2: ``hybrid.interop.gpt2``);
- a tied model has no ``lm_head.weight`` in the files.

Every tensor of either side must be used, or the conversion fails with one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid.interop.hf_dir import ConversionError

if TYPE_CHECKING:
    import torch

EMBEDDING, HEAD = "embedding.word_embeddings.weight", "head.output_layer.weight"
OUTSIDE = ((EMBEDDING, "model.embed_tokens.weight"), ("final_norm.weight", "model.norm.weight"))
# (hybrid name in block b, HF name in model.layers.{b-1})
BLOCK = (("input_norm.weight", "input_layernorm.weight"),
         ("attention.proj.weight", "self_attn.o_proj.weight"),
         ("mlp_norm.weight", "post_attention_layernorm.weight"),
         ("mlp.gate.weight", "mlp.gate_proj.weight"), ("mlp.up.weight", "mlp.up_proj.weight"),
         ("mlp.down.weight", "mlp.down_proj.weight"))
QKV = ("q_proj", "k_proj", "v_proj")
IGNORED = ("rotary_emb.inv_freq",)
"""Buffers older transformers saved with Llama weights: not parameters."""


def _pairs(model: Any) -> list[tuple[str, str]]:
    pairs = list(OUTSIDE)
    for b in range(1, model.layers + 1):
        pairs += [(f"blocks.{b}.{ours}", f"model.layers.{b - 1}.{theirs}")
                  for ours, theirs in BLOCK]
    return pairs if model.tie_embeddings else pairs + [(HEAD, "lm_head.weight")]


def _split_qkv(fused: torch.Tensor, model: Any) -> list[torch.Tensor]:
    """hybrid's ``[(n + 2k) d, h]`` -> HF's ``q [n d, h]``, ``k [k d, h]``, ``v [k d, h]``."""
    kv, d, h = model.kv, model.hidden // model.heads, fused.shape[1]
    per = model.heads // kv
    grouped = fused.reshape(kv, per + 2, d, h)
    return [grouped[:, :per].reshape(kv * per * d, h), grouped[:, per].reshape(kv * d, h),
            grouped[:, per + 1].reshape(kv * d, h)]


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: Any) -> torch.Tensor:
    import torch

    kv, d, h = model.kv, model.hidden // model.heads, q.shape[1]
    per = model.heads // kv
    return torch.cat([q.reshape(kv, per, d, h), k.reshape(kv, 1, d, h),
                      v.reshape(kv, 1, d, h)], dim=1).reshape(-1, h)


def to_hf(weights: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """hybrid global weights (``model``: a ``ModelConfig``) -> HF LlamaForCausalLM tensors."""
    out = {}
    for ours, theirs in _pairs(model):
        tensor = _take(weights, ours, model)
        out[theirs] = tensor[:model.vocab] if ours in (EMBEDDING, HEAD) else tensor
    for b in range(1, model.layers + 1):
        fused = _take(weights, f"blocks.{b}.attention.qkv.weight", model)
        for part, tensor in zip(QKV, _split_qkv(fused, model)):
            out[f"model.layers.{b - 1}.self_attn.{part}.weight"] = tensor
    _all_used(weights, len(out) - 2 * model.layers)
    return {name: t.detach().contiguous().clone() for name, t in out.items()}


def from_hf(tensors: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM tensors -> hybrid global weights with ``model.vocab`` rows."""
    import torch

    tensors = {k: v for k, v in tensors.items() if not k.endswith(IGNORED)}
    if model.tie_embeddings and "lm_head.weight" in tensors:
        if not torch.equal(tensors.pop("lm_head.weight"), tensors[OUTSIDE[0][1]]):
            raise ConversionError("tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight; set tie_word_embeddings=false")
    _check_shapes(tensors, model)
    out = {ours: _take(tensors, theirs, model) for ours, theirs in _pairs(model)}
    for b in range(1, model.layers + 1):
        parts = [_take(tensors, f"model.layers.{b - 1}.self_attn.{p}.weight", model) for p in QKV]
        out[f"blocks.{b}.attention.qkv.weight"] = _fuse_qkv(*parts, model)
    _all_used(tensors, len(out) + 2 * model.layers)
    return {name: t.detach().contiguous().clone() for name, t in out.items()}


def _check_shapes(tensors: dict, model: Any) -> None:
    """Every HF tensor has the shape config.json implies (the parameter spec's; q, k and v
    the fused matrix's parts), so a disagreeing config is named at import, not after launch."""
    from hybrid.planning.params import model_param_specs

    specs, d = model_param_specs(model), model.hidden // model.heads
    expected = {theirs: (model.vocab, *specs[ours].shape[1:]) if ours in (EMBEDDING, HEAD)
                else tuple(specs[ours].shape) for ours, theirs in _pairs(model)}
    for b in range(model.layers):
        for part, rows in zip(QKV, (model.heads * d, model.kv * d, model.kv * d)):
            expected[f"model.layers.{b}.self_attn.{part}.weight"] = (rows, model.hidden)
    for name, shape in expected.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ConversionError(
                f"{name} has shape {list(tensors[name].shape)}, config.json implies "
                f"{list(shape)} (hidden_size={model.hidden}, intermediate_size="
                f"{model.ffn}, num_key_value_heads={model.kv}, vocab_size={model.vocab}); the "
                f"config and the weights disagree: use the config.json saved with these weights")


def _take(source: dict, name: str, model: Any):
    if name not in source:
        raise ConversionError(f"the weights lack {name}; they are not those of this model "
                              f"({model.layers} layers, tied={model.tie_embeddings})")
    return source[name]


def _all_used(source: dict, used: int) -> None:
    if len(source) != used:
        raise ConversionError(f"{len(source) - used} tensors have no place in the model; the "
                              f"config and the weights disagree")


def hf_config(model: Any, eod: int | None = None) -> dict:
    """``config.json`` of the HF Llama equal to ``model`` (a ``ModelConfig``)."""
    return dense_hf_config(model, eod)


def dense_hf_config(model: Any, eod: int | None = None) -> dict:
    """The Llama ``config.json`` fields (Mixtral's start from them)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float32",
        "vocab_size": model.vocab, "hidden_size": model.hidden,
        "intermediate_size": model.ffn, "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads, "num_key_value_heads": model.kv,
        "head_dim": model.hidden // model.heads, "hidden_act": "silu",
        "max_position_embeddings": model.seq_len, "rms_norm_eps": model.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_base},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "pretraining_tp": 1, "initializer_range": model.init_std,
        "tie_word_embeddings": model.tie_embeddings, "bos_token_id": eod, "eos_token_id": eod,
        "pad_token_id": None, "use_cache": True,
    }


def _rope(config: dict, source: str) -> float:
    """The rotary base of an HF config (transformers 5's ``rope_parameters``, or 4's
    ``rope_theta`` and ``rope_scaling``); a scaled rope is refused, named."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ConversionError(f"{source}: rope type {kind!r} (rope_scaling) cannot be "
                              f"converted: hybrid's rotary positions are unscaled")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def model_fields(config: dict, source: str) -> dict:
    """``ModelConfig`` fields of an HF Llama ``config.json``; ``ConversionError`` naming the
    first setting hybrid cannot represent."""
    refused = {"hidden_act": ("silu", "hybrid's SwiGLU uses SiLU"),
               "attention_bias": (False, "hybrid's llama has no biases"),
               "mlp_bias": (False, "hybrid's llama has no biases"),
               "sliding_window": (None, "hybrid's attention is full causal attention")}
    for key, (allowed, why) in refused.items():
        value = config.get(key, allowed)
        if value != allowed:
            raise ConversionError(f"{source}: {key}={value!r} cannot be converted: {why}")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim", hidden // heads) * heads != hidden:
        raise ConversionError(f"{source}: head_dim={config['head_dim']} x num_attention_heads="
                              f"{heads} is not hidden_size={hidden}; hybrid cannot convert it")
    return {"name": "hf-llama", "layers": config["num_hidden_layers"],
            "hidden": hidden, "heads": heads,
            "kv_heads": config.get("num_key_value_heads", heads),
            "ffn_hidden": config["intermediate_size"], "vocab": config["vocab_size"],
            "seq_len": config["max_position_embeddings"],
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            "norm_eps": config.get("rms_norm_eps", 1e-6), "rope_base": _rope(config, source),
            "init_std": config.get("initializer_range", 0.02)}
