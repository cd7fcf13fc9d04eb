"""The llama family's HF variants, config side: which HF ``model_type`` holds which of the
family's fields, read from ``config.json`` on import and written back on export (the weights'
names are ``hybrid.interop.llama``'s).

| model_type | its fields                                                       |
| ---------- | ---------------------------------------------------------------- |
| llama      | ``rope_scaling`` default or llama3 (Llama 3.1-3.3), ``head_dim`` |
| qwen2      | ``qkv_bias`` (always on)                                         |
| qwen3      | ``qk_norm`` (always on), ``head_dim``                            |
| mistral    | ``sliding_window``, ``head_dim``                                 |

Every variant takes the rope types ``ROPE_TYPES``; another (yarn, dynamic, longrope, linear)
is refused in one line naming it and those, before any tensor is read.
"""

from __future__ import annotations

from typing import Any

from hybrid.interop.hf_dir import ConversionError

ROPE_TYPES = ("default", "llama3")
"""HF rope types hybrid builds: ``model.rope_scaling`` none and llama3."""
LLAMA3_KEYS = (("rope_factor", "factor"), ("rope_low_freq_factor", "low_freq_factor"),
               ("rope_high_freq_factor", "high_freq_factor"),
               ("rope_original_positions", "original_max_position_embeddings"))
"""(``ModelConfig`` field, HF's rope_parameters key) of a llama3 rope."""
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


def rope_parameters(model: Any) -> dict:
    """transformers 5's ``rope_parameters`` of ``model``."""
    if model.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": model.rope_base}
    return {"rope_type": model.rope_scaling, "rope_theta": model.rope_base,
            **{theirs: getattr(model, ours) for ours, theirs in LLAMA3_KEYS}}


SCALED_TYPES = ("llama3", "yarn", "longrope")
"""Rope types whose ``original_max_position_embeddings`` transformers defaults to
``max_position_embeddings``."""
DEFAULT_THETA = {"mixtral": 1e6}
"""A config class's ``default_theta`` where it is not transformers' 10000."""


def hf_rope(config: dict, source: str) -> tuple[dict, str]:
    """(the rope parameters transformers 5 reads from ``config.json``, the key they came
    from), in its order (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`` and
    ``standardize_rope_params``): a legacy ``rope_scaling``, when set, replaces
    ``rope_parameters``; the dict's ``rope_theta`` outranks the top-level ``rope_theta``,
    which outranks the class's default; the type is ``rope_type``, else ``type``, else
    default; a scaled type's original positions default to ``max_position_embeddings``."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise ConversionError(f"{source}: {key}={rope!r} is not one rope for every layer; "
                              f"hybrid builds one rope of type {' or '.join(ROPE_TYPES)}")
    rope = dict(rope)
    theta = config.get("rope_theta", DEFAULT_THETA.get(config.get("model_type"), 10000.0))
    rope.setdefault("rope_theta", theta)
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in SCALED_TYPES:
        rope.setdefault("original_max_position_embeddings",
                        config.get("max_position_embeddings"))
    return rope, key


def rope_fields(config: dict, source: str) -> dict:
    """The rope fields of an HF config (``hf_rope``); a rope type hybrid does not build is
    refused in one line naming it and the built ones."""
    rope, key = hf_rope(config, source)
    kind = rope["rope_type"]
    if kind not in ROPE_TYPES:
        raise ConversionError(f"{source}: rope type {kind!r} ({key}) is not supported; "
                              f"hybrid builds {', '.join(ROPE_TYPES)}")
    base = float(rope["rope_theta"])
    if kind == "default":
        return {"rope_base": base}
    fields = {"rope_base": base, "rope_scaling": kind}
    for ours, theirs in LLAMA3_KEYS:
        if rope.get(theirs) is None:
            raise ConversionError(f"{source}: rope type llama3 lacks {theirs}; the config is "
                                  f"incomplete")
        fields[ours] = type(_DEFAULTS[ours])(rope[theirs])
    return fields


_DEFAULTS = {"rope_factor": 1.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
             "rope_original_positions": 8192}


def _refuse(config: dict, source: str, refused: dict) -> None:
    for key, (allowed, why) in refused.items():
        value = config.get(key, allowed)
        if value != allowed:
            raise ConversionError(f"{source}: {key}={value!r} cannot be converted: {why}")


def variant_fields(config: dict, source: str) -> dict:
    """``ModelConfig`` fields of an HF llama, qwen2, qwen3, mistral (or mixtral's dense part)
    ``config.json``; ``ConversionError`` naming the first setting hybrid cannot represent."""
    kind = config.get("model_type", "llama")
    no_bias = "hybrid's llama has biases only on q/k/v (Qwen2's)"
    refused = {"hidden_act": ("silu", "hybrid's SwiGLU uses SiLU"),
               "attention_bias": (False, no_bias), "mlp_bias": (False, no_bias),
               "use_sliding_window": (False, "hybrid's sliding window is Mistral's (every "
                                             "layer); use model_type mistral")}
    if kind != "mistral":
        refused["sliding_window"] = (None, "a sliding window is Mistral's (model_type "
                                           "mistral)")
    _refuse(config, source, refused if kind not in ("qwen2", "qwen3") else
            {k: v for k, v in refused.items() if k != "sliding_window"})
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    window = config.get("sliding_window") if kind == "mistral" else None
    return {"name": f"hf-{kind}", "layers": config["num_hidden_layers"],
            "hidden": hidden, "heads": heads,
            "kv_heads": config.get("num_key_value_heads", heads),
            "ffn_hidden": config["intermediate_size"], "vocab": config["vocab_size"],
            "seq_len": config["max_position_embeddings"],
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            "norm_eps": config.get("rms_norm_eps", 1e-6), **rope_fields(config, source),
            "init_std": config.get("initializer_range", 0.02),
            "head_dim": None if head_dim * heads == hidden else head_dim,
            "qkv_bias": kind == "qwen2", "qk_norm": kind == "qwen3", "sliding_window": window}


def _model_type(model: Any) -> str:
    """The HF variant that holds ``model``'s fields; ``ConversionError`` where none does."""
    if model.qkv_bias and (model.qk_norm or model.sliding_window is not None):
        raise ConversionError("model.qkv_bias with model.qk_norm or model.sliding_window has "
                              "no HF model_type (Qwen2 has biases, Qwen3 norms, Mistral the "
                              "window); export with --format torch")
    if model.qk_norm and model.sliding_window is not None:
        raise ConversionError("model.qk_norm with model.sliding_window has no HF model_type "
                              "here; export with --format torch")
    if model.qkv_bias:
        return "qwen2"
    if model.qk_norm:
        return "qwen3"
    return "mistral" if model.sliding_window is not None else "llama"


def variant_hf_config(model: Any, eod: int | None = None) -> dict:
    """``config.json`` of the HF model equal to ``model``: Llama's fields, then the variant's."""
    kind = _model_type(model)
    config = dense_hf_config(model, eod)
    config.update(model_type=kind, architectures=[ARCHITECTURES[kind]])
    if kind in ("qwen2", "qwen3"):
        for key in ("mlp_bias", "pretraining_tp"):
            config.pop(key)
        config.update(use_sliding_window=False, sliding_window=None,
                      max_window_layers=model.layers)
    if kind == "mistral":
        for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
            config.pop(key)
        config["sliding_window"] = model.sliding_window
    return config


def dense_hf_config(model: Any, eod: int | None = None) -> dict:
    """The Llama ``config.json`` fields (Mixtral's and the variants' start from them)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float32",
        "vocab_size": model.vocab, "hidden_size": model.hidden,
        "intermediate_size": model.ffn, "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads, "num_key_value_heads": model.kv,
        "head_dim": model.head_size, "hidden_act": "silu",
        "max_position_embeddings": model.seq_len, "rms_norm_eps": model.norm_eps,
        "rope_parameters": rope_parameters(model),
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "pretraining_tp": 1, "initializer_range": model.init_std,
        "tie_word_embeddings": model.tie_embeddings, "bos_token_id": eod, "eos_token_id": eod,
        "pad_token_id": None, "use_cache": True,
    }
