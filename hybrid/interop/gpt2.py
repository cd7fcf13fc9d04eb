"""hybrid's GPT <-> HF ``GPT2LMHeadModel``: the names, the layouts and the config, exactly.

hybrid's GPT is GPT-2's architecture (pre-LayerNorm, tanh GELU, learned positions, biases,
optionally tied embeddings), so the conversion is a renaming plus four re-layouts:

- HF's ``Conv1D`` stores ``[in, out]`` where hybrid's linears store ``[out, in]``:
  ``c_proj``, ``c_fc`` and ``mlp.c_proj`` are transposed;
- the fused QKV: hybrid's rows are head-major ``(head, q|k|v, head_dim)`` (Megatron's), HF's
  columns ``(q|k|v, head, head_dim)``;
- the vocabulary: hybrid pads it for TP (``model.vocab_pad_multiple``), HF has none. Export
  drops the padding rows, import stores the real rows and ``pad_vocabulary`` adds zero rows
  for a model that pads. hybrid's cross entropy masks the padding columns, so the losses are
  equal either way;
- a tied model has no ``lm_head.weight`` in the files (HF ties it on load; a differing one
  would silently untie it).

Names here are hybrid's global parameter names (``hybrid.planning.params``); every tensor of
either side must be used, or the conversion fails with one line, and on import every HF tensor
must have the shape its config.json implies (the parameter spec's, re-laid out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from hybrid.interop.hf_dir import ConversionError
from hybrid.planning.params import model_param_specs

if TYPE_CHECKING:  # torch is imported where tensors are touched: a bad config fails at once
    import torch

TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate", "gelu_python_tanh")
"""HF activation names that are tanh-GELU (hybrid's), equal to it within 5e-7 in fp32."""
LEGACY_BUFFERS = (".attn.bias", ".attn.masked_bias")
"""Attention-mask buffers older transformers saved with GPT-2 weights: not parameters."""
EMBEDDING, HEAD = "embedding.word_embeddings.weight", "head.output_layer.weight"

# (hybrid name in block b, HF name in transformer.h.{b-1}, re-layout)
BLOCK = (("input_norm.weight", "ln_1.weight", "same"), ("input_norm.bias", "ln_1.bias", "same"),
         ("attention.qkv.weight", "attn.c_attn.weight", "qkv_weight"),
         ("attention.qkv.bias", "attn.c_attn.bias", "qkv_bias"),
         ("attention.proj.weight", "attn.c_proj.weight", "transpose"),
         ("attention.proj.bias", "attn.c_proj.bias", "same"),
         ("mlp_norm.weight", "ln_2.weight", "same"), ("mlp_norm.bias", "ln_2.bias", "same"),
         ("mlp.fc1.weight", "mlp.c_fc.weight", "transpose"),
         ("mlp.fc1.bias", "mlp.c_fc.bias", "same"),
         ("mlp.fc2.weight", "mlp.c_proj.weight", "transpose"),
         ("mlp.fc2.bias", "mlp.c_proj.bias", "same"))
OUTSIDE = ((EMBEDDING, "transformer.wte.weight", "vocab"),
           ("embedding.position_embeddings", "transformer.wpe.weight", "same"),
           ("final_norm.weight", "transformer.ln_f.weight", "same"),
           ("final_norm.bias", "transformer.ln_f.bias", "same"))


def name_pairs(layers: int, tied: bool) -> list[tuple[str, str, str]]:
    """Every (hybrid name, HF name, re-layout) of a model."""
    pairs = list(OUTSIDE)
    for b in range(1, layers + 1):
        pairs += [(f"blocks.{b}.{ours}", f"transformer.h.{b - 1}.{theirs}", how)
                  for ours, theirs, how in BLOCK]
    return pairs if tied else pairs + [(HEAD, "lm_head.weight", "vocab")]


def _qkv(tensor: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    """Reorder the fused QKV's output dimension (dim 0 of hybrid's ``[3h, ...]``)."""
    rest = tensor.shape[1:]
    d = tensor.shape[0] // (3 * heads)
    first, second = ((heads, 3), (3, heads)) if to_hf else ((3, heads), (heads, 3))
    return tensor.reshape(*first, d, *rest).transpose(0, 1).reshape(3 * heads * d, *rest)


def _relayout(how: str, tensor: torch.Tensor, heads: int, vocab: int, to_hf: bool):
    if how == "transpose":
        return tensor.t()
    if how == "qkv_weight":
        return _qkv(tensor, heads, True).t() if to_hf else _qkv(tensor.t(), heads, False)
    if how == "qkv_bias":
        return _qkv(tensor, heads, to_hf)
    if how == "vocab" and to_hf:
        return tensor[:vocab]  # padding rows are no tokens
    return tensor


def to_hf(weights: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """hybrid global weights (``model``: a ``ModelConfig``) -> HF GPT2LMHeadModel tensors."""
    pairs = name_pairs(model.layers, model.tie_embeddings)
    return _convert(weights, [(ours, theirs, how) for ours, theirs, how in pairs], model, True)


def from_hf(tensors: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """HF GPT2LMHeadModel tensors -> hybrid global weights with ``model.vocab`` rows (no
    padding: ``pad_vocabulary`` adds it for a model that pads)."""
    tensors = {("transformer." + k if not k.startswith(("transformer.", "lm_head.")) else k): v
               for k, v in tensors.items() if not k.endswith(LEGACY_BUFFERS)}  # GPT2Model keys
    import torch

    if model.tie_embeddings and "lm_head.weight" in tensors:
        if not torch.equal(tensors.pop("lm_head.weight"), tensors["transformer.wte.weight"]):
            raise ConversionError("tie_word_embeddings is true but lm_head.weight differs from "
                                  "transformer.wte.weight; set tie_word_embeddings=false")
    pairs = name_pairs(model.layers, model.tie_embeddings)
    _check_shapes(tensors, pairs, model)
    return _convert(tensors, [(theirs, ours, how) for ours, theirs, how in pairs], model, False)


def _check_shapes(tensors: dict, pairs: list, model: Any) -> None:
    """Every HF tensor of ``pairs`` has the shape ``model`` (from config.json) gives it."""
    specs = model_param_specs(model)
    for ours, theirs, how in pairs:
        if theirs not in tensors:
            continue  # _convert names what is missing
        shape = specs[ours].shape
        if how in ("transpose", "qkv_weight"):  # Conv1D stores [in, out]
            shape = shape[::-1]
        elif how == "vocab":
            shape = (model.vocab, *shape[1:])
        found = tuple(tensors[theirs].shape)
        if found != shape:
            raise ConversionError(
                f"{theirs} has shape {list(found)}, config.json implies {list(shape)} "
                f"(n_embd={model.hidden}, n_inner={model.ffn}, n_positions={model.seq_len}, "
                f"vocab_size={model.vocab}); the config and the weights disagree: use the "
                f"config.json saved with these weights")


def _convert(source: dict, pairs: list, model: Any, to_hf: bool) -> dict[str, torch.Tensor]:
    out = {}
    for src, dst, how in pairs:
        if src not in source:
            raise ConversionError(f"the weights lack {src}; they are not those of this model "
                                  f"({model.layers} layers, tied={model.tie_embeddings})")
        tensor = _relayout(how, source[src].detach(), model.heads, model.vocab, to_hf)
        out[dst] = tensor.contiguous().clone()  # own storage: safetensors refuses shared ones
    unused = sorted(set(source) - {src for src, _, _ in pairs})
    if unused:
        raise ConversionError(f"{len(unused)} tensors have no place in the model (first: "
                              f"{unused[0]}); the config and the weights disagree")
    return out


def pad_vocabulary(weights: dict[str, torch.Tensor], padded: int) -> dict[str, torch.Tensor]:
    """The vocabulary matrices with zero rows up to ``padded`` (masked in the loss, never an
    input: any value trains the same)."""
    import torch

    out = dict(weights)
    for name in (EMBEDDING, HEAD):
        if name in out and out[name].shape[0] < padded:
            rows = out[name]
            out[name] = torch.cat([rows, rows.new_zeros(padded - rows.shape[0], rows.shape[1])])
    return out


def hf_config(model: Any, eod: int | None = None) -> dict:
    """``config.json`` of the HF GPT-2 equal to ``model`` (a ``ModelConfig``): no dropout
    (hybrid trains without), GPT-2's own ``gelu_new``; ``eod``: the end-of-document id, HF's
    bos/eos (generation stops there)."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "dtype": "float32",
        "vocab_size": model.vocab, "n_positions": model.seq_len, "n_embd": model.hidden,
        "n_layer": model.layers, "n_head": model.heads, "n_inner": model.ffn_hidden,
        "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0, "layer_norm_epsilon": model.norm_eps,
        "initializer_range": model.init_std, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "add_cross_attention": False, "tie_word_embeddings": model.tie_embeddings,
        "bos_token_id": eod, "eos_token_id": eod, "pad_token_id": None, "use_cache": True,
    }


REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("model_type", lambda v: v != "gpt2", "only GPT-2 (model_type gpt2) converts"),
    ("activation_function", lambda v: v not in TANH_GELU,
     f"hybrid's GELU is the tanh one ({', '.join(TANH_GELU)})"),
    ("scale_attn_weights", lambda v: v is False, "hybrid always scales attention by 1/sqrt(d)"),
    ("scale_attn_by_inverse_layer_idx", lambda v: v is True, "hybrid has no per-layer scaling"),
    ("add_cross_attention", lambda v: v is True, "hybrid is decoder-only"),
)
DEFAULTS = {"model_type": None, "activation_function": "gelu_new", "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}


def model_fields(config: dict, source: str) -> dict:
    """``ModelConfig`` fields of an HF GPT-2 ``config.json``; ``ConversionError`` naming the
    first setting hybrid cannot represent."""
    for key, refused, why in REFUSED:
        value = config.get(key, DEFAULTS[key])
        if refused(value):
            raise ConversionError(f"{source}: {key}={value!r} cannot be converted: {why}")
    if config["n_embd"] % config["n_head"]:
        raise ConversionError(f"{source}: n_head={config['n_head']} does not divide "
                              f"n_embd={config['n_embd']}")
    return {"name": "hf-gpt2", "layers": config["n_layer"], "hidden": config["n_embd"],
            "heads": config["n_head"], "ffn_hidden": config.get("n_inner"),
            "vocab": config["vocab_size"], "seq_len": config["n_positions"],
            "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
            "norm_eps": config.get("layer_norm_epsilon", 1e-5),
            "init_std": config.get("initializer_range", 0.02)}
