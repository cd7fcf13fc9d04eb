"""hybrid's llama <-> HF ``LlamaForCausalLM``: the names, the layouts and the config.

hybrid's llama is HF Llama's architecture (pre-RMSNorm, SwiGLU, rotary positions in HF's
``rotate_half`` convention, grouped-query attention, no biases), and Qwen2's q/k/v biases and
Qwen3's q/k norms are its variants' (``hybrid.interop.llama_variants`` reads and writes their
configs), so the conversion is a renaming plus two re-layouts:

- the fused QKV: hybrid's rows are per key/value group ``(group, its query heads | key |
  value, head_dim)`` (Megatron's), HF's are three matrices ``q_proj``, ``k_proj``, ``v_proj``
  (and Qwen2's three biases, laid out the same);
- the vocabulary: hybrid pads it, HF has none (as for GPT-2: ``hybrid.interop.gpt2``);
- a tied model has no ``lm_head.weight`` in the files.

Every tensor of either side must be used, or the conversion fails with one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybrid.interop.hf_dir import ConversionError
from hybrid.interop.llama_variants import dense_hf_config, variant_fields, variant_hf_config

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


HEAD_NORMS = (("attention.q_norm.weight", "self_attn.q_norm.weight"),
              ("attention.k_norm.weight", "self_attn.k_norm.weight"))
"""Qwen3's per-head query and key RMSNorms (``model.qk_norm``)."""


def _pairs(model: Any) -> list[tuple[str, str]]:
    block = BLOCK + (HEAD_NORMS if getattr(model, "qk_norm", False) else ())
    pairs = list(OUTSIDE)
    for b in range(1, model.layers + 1):
        pairs += [(f"blocks.{b}.{ours}", f"model.layers.{b - 1}.{theirs}")
                  for ours, theirs in block]
    return pairs if model.tie_embeddings else pairs + [(HEAD, "lm_head.weight")]


def _qkv_parts(model: Any) -> tuple[str, ...]:
    """The fused QKV's parameters: its weight and, with ``model.qkv_bias`` (Qwen2), its bias."""
    return ("weight", "bias") if getattr(model, "qkv_bias", False) else ("weight",)


def _split_qkv(fused: torch.Tensor, model: Any) -> list[torch.Tensor]:
    """hybrid's ``[(n + 2k) d, ...]`` -> HF's ``q [n d, ...]``, ``k [k d, ...]``, ``v [k d,
    ...]`` (a weight ``...`` = ``h``, a bias none)."""
    kv, d, rest = model.kv, model.head_size, tuple(fused.shape[1:])
    per = model.heads // kv
    grouped = fused.reshape(kv, per + 2, d, *rest)
    return [grouped[:, :per].reshape(kv * per * d, *rest),
            grouped[:, per].reshape(kv * d, *rest), grouped[:, per + 1].reshape(kv * d, *rest)]


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: Any) -> torch.Tensor:
    import torch

    kv, d, rest = model.kv, model.head_size, tuple(q.shape[1:])
    per = model.heads // kv
    return torch.cat([q.reshape(kv, per, d, *rest), k.reshape(kv, 1, d, *rest),
                      v.reshape(kv, 1, d, *rest)], dim=1).reshape(-1, *rest)


def to_hf(weights: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """hybrid global weights (``model``: a ``ModelConfig``) -> HF LlamaForCausalLM tensors."""
    out = {}
    for ours, theirs in _pairs(model):
        tensor = _take(weights, ours, model)
        out[theirs] = tensor[:model.vocab] if ours in (EMBEDDING, HEAD) else tensor
    kinds = _qkv_parts(model)
    for b in range(1, model.layers + 1):
        for kind in kinds:
            fused = _take(weights, f"blocks.{b}.attention.qkv.{kind}", model)
            for part, tensor in zip(QKV, _split_qkv(fused, model)):
                out[f"model.layers.{b - 1}.self_attn.{part}.{kind}"] = tensor
    _all_used(weights, len(out) - 2 * model.layers * len(kinds))
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
    kinds = _qkv_parts(model)
    for b in range(1, model.layers + 1):
        for kind in kinds:
            parts = [_take(tensors, f"model.layers.{b - 1}.self_attn.{p}.{kind}", model)
                     for p in QKV]
            out[f"blocks.{b}.attention.qkv.{kind}"] = _fuse_qkv(*parts, model)
    _all_used(tensors, len(out) + 2 * model.layers * len(kinds))
    return {name: t.detach().contiguous().clone() for name, t in out.items()}


def _check_shapes(tensors: dict, model: Any) -> None:
    """Every HF tensor has the shape config.json implies (the parameter spec's; q, k and v
    the fused matrix's parts), so a disagreeing config is named at import, not after launch."""
    from hybrid.planning.params import model_param_specs

    specs, d = model_param_specs(model), model.head_size
    expected = {theirs: (model.vocab, *specs[ours].shape[1:]) if ours in (EMBEDDING, HEAD)
                else tuple(specs[ours].shape) for ours, theirs in _pairs(model)}
    for b in range(model.layers):
        for part, rows in zip(QKV, (model.heads * d, model.kv * d, model.kv * d)):
            expected[f"model.layers.{b}.self_attn.{part}.weight"] = (rows, model.hidden)
            expected[f"model.layers.{b}.self_attn.{part}.bias"] = (rows,)
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
    """``config.json`` of the HF model equal to ``model`` (a ``ModelConfig``): Llama, or the
    variant its fields name (``hybrid.interop.llama_variants``)."""
    return variant_hf_config(model, eod)


def model_fields(config: dict, source: str) -> dict:
    """``ModelConfig`` fields of an HF Llama (or Qwen2, Qwen3, Mistral, Mixtral's dense part)
    ``config.json``; ``ConversionError`` naming the first setting hybrid cannot represent."""
    return variant_fields(config, source)
