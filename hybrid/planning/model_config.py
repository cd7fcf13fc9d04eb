"""The schema of the model (``model.*``): the family, its shape and its options, one keyword-only
dataclass, a field of ``hybrid.planning.config.Config`` (``conf/model/*.yaml`` are its presets)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


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
    experts: int = 0
    """Mixture of experts (family llama; docs/moe.md): experts per MoE layer, whose sparse MLP
    replaces the SwiGLU MLP; 0 = a dense model."""
    experts_topk: int = 2
    """Experts each token is routed to (experts > 0)."""
    moe_ffn_hidden: Optional[int] = None
    """One expert's SwiGLU inner size; None means ffn_hidden."""
    moe_every: int = 1
    """Every this many layers is an MoE layer, starting with the first (megatron's
    moe_layer_freq); the others keep the dense MLP."""
    moe_dense_layers: List[int] = field(default_factory=list)
    """Layers (1..layers) that keep the dense MLP though moe_every would make them MoE layers
    (HF's mlp_only_layers, counted from 1; DeepSeek's first_k_dense_replace=k is [1..k])."""
    moe_shared_ffn_hidden: int = 0
    """A shared expert in every MoE layer: a SwiGLU of this inner size that every token goes
    through, its output scaled by a sigmoid gate (Qwen2-MoE's shared_expert_intermediate_size
    and shared_expert_gate); 0 = none."""
    moe_norm_topk_prob: bool = True
    """Renormalise the chosen experts' router probabilities to sum to 1 (Mixtral; HF's
    norm_topk_prob); false: each expert's weight is its softmax probability over all experts
    (Qwen2-MoE). Only with moe_router=softmax_topk."""
    moe_aux_loss: float = 0.0
    """Coefficient of the Switch/GShard load-balancing loss added to each MoE layer's
    gradient (0 = off; 0.01 is common)."""
    moe_capacity_factor: Optional[float] = None
    """None: dropless (every routed token is computed). A number > 0: each expert takes at
    most ceil(factor * tokens * topk / experts) of a micro-batch's tokens, in token order,
    and drops the rest."""
    moe_expert_bias_rate: float = 0.0
    """Auxiliary-loss-free load balancing (DeepSeek-V3; megatron's
    moe_router_bias_update_rate): each MoE layer keeps a per-expert bias, added to the router's
    probabilities only to choose the top-k, and after every optimizer step moved by this rate
    toward an even load (sign of the mean load minus each expert's, over the whole global
    batch). 0 = off (no bias); 1e-3 is megatron's default."""
    moe_router: str = "softmax_topk"
    """softmax_topk (Mixtral: softmax over the experts, top-k, renormalised) | topk_softmax
    (top-k of the logits, softmax over those k: megatron's default; the same weights in exact
    arithmetic)."""

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def moe_ffn(self) -> int:
        """One expert's inner size (``moe_ffn_hidden``, or ``ffn``)."""
        return self.moe_ffn_hidden if self.moe_ffn_hidden is not None else self.ffn

    def is_moe_layer(self, block_id: int) -> bool:
        """Whether block ``block_id`` (1..layers) has a sparse MLP: its layer spec's
        (``hybrid.planning.models.layers.layer_spec``, the one rule)."""
        from hybrid.planning.models.layers import layer_spec

        return layer_spec(self, block_id).moe

    def cache_key(self) -> tuple:
        """The fields as a hashable tuple (a list made a tuple): what the planning caches key
        a model by; ``ModelConfig(**dict(key))`` builds it back."""
        return tuple((name, tuple(value) if isinstance(value, list) else value)
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
