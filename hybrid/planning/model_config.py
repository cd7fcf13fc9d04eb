"""The schema of the model (``model.*``): the family, its shape and its options, one keyword-only
dataclass, a field of ``hybrid.planning.config.Config`` (``conf/model/*.yaml`` are its presets),
with the mixture-of-experts settings nested under ``model.moe`` (``moe_config``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

from hybrid.planning.moe_config import MoEConfig, as_moe_config, flat_keys


@flat_keys
@dataclass(kw_only=True)
class ModelConfig:
    name: str = "tiny"
    """Preset name, for display."""
    from_hf: Optional[str] = None
    """A local HF model folder (config.json and safetensors, sharded or not): its shape
    replaces this config's (model.seq_len, vocab_pad_multiple and recompute stay yours) and
    its weights start the run, each rank reading only its own slices (docs/models.md)."""
    family: str = "gpt2"
    """The model family (hybrid.planning.models; docs/models.md): gpt2, or one registered by
    family_module."""
    family_module: Optional[str] = None
    """A module to import before the family is looked up (in the launcher and on every rank),
    which registers model.family: for a family defined outside hybrid (on PYTHONPATH)."""
    layers: int = 4
    """Number of transformer layers."""
    hidden: int = 32
    """Hidden size h."""
    heads: int = 4
    """Attention heads; must divide hidden."""
    kv_heads: Optional[int] = None
    """Key/value heads (grouped-query attention, family llama): must divide heads, and tp must
    divide it; None means heads (multi-head attention)."""
    ffn_hidden: Optional[int] = None
    """MLP inner size; None means 4 * hidden."""
    vocab: int = 256
    """Vocabulary size before padding (256 = byte-level tokens)."""
    vocab_pad_multiple: int = 64
    """The vocabulary is padded up to a multiple of this (independent of TP, so every layout
    trains the same model); tp must divide the padded size."""
    seq_len: int = 32
    """Maximum sequence length (rows of the learned position table); also the training length."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer (GPT-2 style)."""
    recompute: str = "none"
    """none | selective (keep each layer's activations except the attention core's, which
    the backward recomputes: Korthikanti et al. 2022) | full (keep only each transformer
    layer's input and recompute the whole layer in the backward)."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    norm_eps: float = 1e-5
    """The norms' epsilon (LayerNorm for gpt2, RMSNorm for llama)."""
    rope_base: float = 10000.0
    """Rotary position embeddings' base (family llama; HF's rope_theta)."""
    rope_scaling: str = "none"
    """none | llama3 (Llama 3.1-3.3's rope_scaling: each rotary frequency whose wavelength is
    longer than rope_original_positions / rope_low_freq_factor is divided by rope_factor,
    those shorter than rope_original_positions / rope_high_freq_factor kept, those between
    blended, as HF's _compute_llama3_parameters). Other HF rope types are refused."""
    rope_factor: float = 1.0
    """rope_scaling=llama3: HF's factor (Llama 3.2: 32)."""
    rope_low_freq_factor: float = 1.0
    """rope_scaling=llama3: HF's low_freq_factor."""
    rope_high_freq_factor: float = 4.0
    """rope_scaling=llama3: HF's high_freq_factor."""
    rope_original_positions: int = 8192
    """rope_scaling=llama3: HF's original_max_position_embeddings."""
    head_dim: Optional[int] = None
    """Attention head size (family llama; HF's head_dim: Qwen3's differ from hidden/heads);
    None means hidden / heads."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (family llama: Qwen2/2.5), split over
    TP with their rows."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head (one scale of head_dim, shared by the heads)
    before the rotary positions (family llama: Qwen3)."""
    sliding_window: Optional[int] = None
    """Each token attends to itself and the sliding_window - 1 tokens before it (family llama:
    Mistral); None means full causal attention."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture of experts (``model.moe.experts=8``; ``hybrid.planning.moe_config``, docs/moe.md):
    empty in a dense preset (experts=0). The flat keys of before (``model.experts``,
    ``model.moe_aux_loss``, ...) still work: see below."""

    def __post_init__(self):
        self.moe = as_moe_config(self.moe)  # a saved config's dict, or cache_key's pairs

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    def with_moe(self, **changes) -> "ModelConfig":
        """A copy with ``changes`` to the MoE settings (``cfg.with_moe(every=2)``)."""
        return replace(self, moe=replace(self.moe, **changes))

    @property
    def moe_ffn(self) -> int:
        """One expert's inner size (``moe.ffn_hidden``, or ``ffn``)."""
        return self.moe.ffn_hidden if self.moe.ffn_hidden is not None else self.ffn

    def is_moe_layer(self, block_id: int) -> bool:
        """Whether block ``block_id`` (1..layers) has a sparse MLP: its layer spec's
        (``hybrid.planning.models.layers.layer_spec``, the one rule)."""
        from hybrid.planning.models.layers import layer_spec

        return layer_spec(self, block_id).moe

    def cache_key(self) -> tuple:
        """The fields as a hashable tuple (a list made a tuple, ``moe`` a tuple of pairs): what
        the planning caches key a model by; ``ModelConfig(**dict(key))`` builds it back."""
        return tuple((name, value if type(value) in _PLAIN else _hashable(value))
                     for name, value in vars(self).items())

    @property
    def head_size(self) -> int:
        """One attention head's size (``head_dim``, or ``hidden / heads``)."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def kv(self) -> int:
        """Key/value heads (``kv_heads``, or ``heads`` when unset)."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def padded_vocab(self) -> int:
        m = self.vocab_pad_multiple
        return -(-self.vocab // m) * m


def setting_paths() -> list[str]:
    """Every ``model.*`` setting as the command line writes it, the MoE ones by their nested
    path (``moe.topk``): what ``hybrid.planning.moved_keys.get_path`` reads."""
    return [f.name for f in fields(ModelConfig) if f.name != "moe"] + \
        [f"moe.{f.name}" for f in fields(MoEConfig)]


_PLAIN = frozenset((int, float, str, bool, type(None)))
"""Field types that are hashable as they are (a search keys a model thousands of times)."""


def _hashable(value: Any) -> Any:
    if isinstance(value, MoEConfig):  # its fields in order, as vars holds them
        return tuple((name, tuple(v) if isinstance(v, list) else v)
                     for name, v in vars(value).items())
    return tuple(value) if isinstance(value, list) else value
