"""Llama's blocks (the family ``llama``'s torch side; its parameter table and shape rules are
``hybrid.planning.models.llama``): rotary positions, RMSNorm, SwiGLU, grouped-query attention,
no biases.

Shapes as GPT-2's blocks (``hybrid.model.blocks``): activations ``[s(/tp), b, h]``. Which parts
are whose: the linears are megatron-core's (``megatron_adapter``); the rotary table is
hybrid's own, computed on the CPU or the activations' device (megatron-core 0.16's
``RotaryEmbedding`` moves its table to CUDA), for each rank's own token positions (under
context parallelism its zigzag chunks); the norm is torch's ``nn.RMSNorm`` (megatron-core's
torch-norm wrapper refuses RMSNorm under sequence parallelism; the norm's ``ParamSpec`` says
its gradient is partial over TP there, as GPT-2's LayerNorm's).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybrid.comm import Group
from hybrid.model.blocks import (Context, HeadBlock, causal_attention, normal_init,
                                 output_init, word_embedding)
from hybrid.model.context import context_positions, windowed_attention
from hybrid.model.families import FamilyBlocks, register_blocks
from hybrid.model.kv_cache import KVCache, LayerCache
from hybrid.model.mappings import (gather_from_sequence_parallel_region,
                                   scatter_to_sequence_parallel_region)
from hybrid.model.megatron_adapter import ColumnParallelLinear, RowParallelLinear
from hybrid.model.moe import MoeMLP
from hybrid.planning.config import ModelConfig
from hybrid.planning.models.layers import layer_spec
from hybrid.planning.models.llama import qkv_rows


def rms_norm(cfg: ModelConfig) -> nn.RMSNorm:
    return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)


def rotary_tables(positions: torch.Tensor, head_dim: int, base: float,
                  cfg: Optional[ModelConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos`` and ``sin`` ``[s, head_dim]`` of the tokens at ``positions``: pair ``i``
    of a head turns by ``position / base^(2i/head_dim)`` (rescaled by ``cfg.rope_scaling``),
    its two halves laid out as HF's ``rotate_half`` expects (the first half of a head's
    dimensions paired with the second)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
    inv_freq = 1.0 / (base ** (exponents.float() / head_dim))
    if cfg is not None and cfg.rope_scaling == "llama3":
        inv_freq = llama3_frequencies(inv_freq, cfg)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def llama3_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's rescaled frequencies, as HF's ``_compute_llama3_parameters``: wavelengths
    longer than ``original / low_freq_factor`` slowed by ``factor``, shorter than ``original /
    high_freq_factor`` kept, those between a blend by how far between they are."""
    original, factor = cfg.rope_original_positions, cfg.rope_factor
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelength < original / high) & ~(wavelength > original / low)
    return torch.where(between, blended, scaled)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on ``[b, n, s, d]`` heads (``cos``/``sin`` ``[s, d]``)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class LlamaEmbedding(nn.Module):
    """Token embedding only (positions are rotary, in attention): ``[b, s]`` -> ``[s(/tp), b,
    h]``."""

    def __init__(self, cfg: ModelConfig, tp_group: Group, *, generator: torch.Generator,
                 sequence_parallel: bool, context: Context = Context()):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.word_embeddings = word_embedding(cfg, tp_group, generator)

    def forward(self, tokens: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        hidden = self.word_embeddings(tokens.t())  # [s, b, h], all-reduced over TP
        if self.sequence_parallel:
            hidden = scatter_to_sequence_parallel_region(hidden, self.tp_group)
        return hidden


class GroupedQueryAttention(nn.Module):
    """Causal attention of ``heads`` query heads over ``kv_heads`` key/value heads, rotary.

    The fused QKV's rows are per key/value group: its ``heads / kv_heads`` query heads, then
    its key, then its value (Megatron's layout), so a TP rank's contiguous slice holds
    ``kv_heads / tp`` whole groups, the same groups' query heads as the 1-process model's.
    """

    def __init__(self, cfg: ModelConfig, tp_group: Group, *, generator: torch.Generator,
                 sequence_parallel: bool, context: Context = Context()):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.context, self.rope_base, self.cfg = context, cfg.rope_base, cfg
        self.recompute_core = cfg.recompute == "selective" and not context.on
        self.head_dim = cfg.head_size
        self.per_group = cfg.heads // cfg.kv
        self.local_groups = cfg.kv // tp_group.size()
        self.window = cfg.sliding_window
        self.qkv = ColumnParallelLinear(cfg.hidden, qkv_rows(cfg), tp_group=tp_group,
                                        init_method=normal_init(cfg.init_std, generator),
                                        bias=cfg.qkv_bias, input_is_gathered=sequence_parallel)
        self.proj = RowParallelLinear(cfg.heads * cfg.head_size, cfg.hidden, tp_group=tp_group,
                                      init_method=output_init(cfg, generator), bias=False,
                                      output_sequence_parallel=sequence_parallel)
        if cfg.qk_norm:  # Qwen3: each head's query and key RMS-normed before the rotation
            self.q_norm = nn.RMSNorm(cfg.head_size, eps=cfg.norm_eps)
            self.k_norm = nn.RMSNorm(cfg.head_size, eps=cfg.norm_eps)

    def forward(self, hidden: torch.Tensor, cache: Optional[LayerCache] = None) -> torch.Tensor:
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group)
        seq, batch = hidden.shape[:2]
        g, per, d = self.local_groups, self.per_group, self.head_dim
        qkv = self.qkv(hidden).view(seq, batch, g, per + 2, d)
        # [s, b, heads, d] -> [b, heads, s, d], the layout scaled_dot_product_attention takes
        q = qkv[:, :, :, :per].reshape(seq, batch, g * per, d).permute(1, 2, 0, 3)
        k, v = (qkv[:, :, :, per + i].permute(1, 2, 0, 3) for i in (0, 1))
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        positions = self._positions(seq, q.device, cache)
        tables = rotary_tables(positions, d, self.rope_base, self.cfg)
        cos, sin = (t.to(q.dtype) for t in tables)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if per > 1:  # each key/value head serves its group's query heads
            k, v = k.repeat_interleave(per, dim=1), v.repeat_interleave(per, dim=1)
        if cache is not None:
            return self.proj(cache.attend(q, k, v, self.window))
        if self.window is not None and self.window < self._sequence(seq):
            return self.proj(windowed_attention(q, k, v, self.window, self.context))
        return self.proj(causal_attention(q, k, v, self.context, self.recompute_core))

    def _sequence(self, local_seq: int) -> int:
        """The whole sequence's length (a context rank holds ``1/cp`` of it)."""
        return local_seq * (self.context.group.size() if self.context.on else 1)

    def _positions(self, seq: int, device: torch.device,
                   cache: Optional[LayerCache]) -> torch.Tensor:
        if self.context.on:
            group = self.context.group
            return context_positions(seq, group.size(), group.rank(), device)
        start = 0 if cache is None or cache.keys is None else cache.keys.shape[2]
        return torch.arange(start, start + seq, device=device)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate and up are each column-parallel, so a rank holds
    the gate and up rows of the same ``ffn / tp`` units."""

    def __init__(self, cfg: ModelConfig, tp_group: Group, *, generator: torch.Generator,
                 sequence_parallel: bool):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        column = dict(tp_group=tp_group, init_method=normal_init(cfg.init_std, generator),
                      bias=False, input_is_gathered=sequence_parallel)
        self.gate = ColumnParallelLinear(cfg.hidden, cfg.ffn, **column)
        self.up = ColumnParallelLinear(cfg.hidden, cfg.ffn, **column)
        self.down = RowParallelLinear(cfg.ffn, cfg.hidden, tp_group=tp_group,
                                      init_method=output_init(cfg, generator), bias=False,
                                      output_sequence_parallel=sequence_parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group)
        return self.down(F.silu(self.gate(hidden)) * self.up(hidden))


class LlamaLayer(nn.Module):
    """Pre-norm layer: ``x + attn(rms(x))``, then ``x + mlp(rms(x))``, the MLP a SwiGLU or,
    in an MoE layer, a ``MoeMLP``: as the layer's spec says (``layer_spec(cfg, block_id)``,
    ``hybrid.planning.models.layers``)."""

    def __init__(self, cfg: ModelConfig, tp_group: Group, *, generator: torch.Generator,
                 sequence_parallel: bool, context: Context = Context(), block_id: int = 1,
                 expert_group: Optional[Group] = None):
        super().__init__()
        self.recompute = cfg.recompute == "full"
        self.input_norm = rms_norm(cfg)
        self.attention = GroupedQueryAttention(cfg, tp_group, generator=generator,
                                               sequence_parallel=sequence_parallel,
                                               context=context)
        self.mlp_norm = rms_norm(cfg)
        spec = layer_spec(cfg, block_id)
        if spec.moe:
            self.mlp = MoeMLP(cfg, tp_group, generator=generator,
                              sequence_parallel=sequence_parallel, expert_group=expert_group,
                              context=context, shared_ffn=spec.shared_ffn)
        else:
            self.mlp = SwiGLU(cfg, tp_group, generator=generator,
                              sequence_parallel=sequence_parallel)

    def forward(self, hidden: torch.Tensor, cache: Optional[LayerCache] = None) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._layer, hidden, use_reentrant=False,
                              context_fn=self.recompute_contexts)
        return self._layer(hidden, cache)

    def recompute_contexts(self) -> tuple[AbstractContextManager, AbstractContextManager]:
        """``checkpoint``'s ``context_fn``: nothing around the forward; around its re-run in
        the backward, an MoE MLP's ``uncounted``, so a step's MoE figures and expert-bias
        counts are those without recompute."""
        again = self.mlp.uncounted() if isinstance(self.mlp, MoeMLP) else nullcontext()
        return nullcontext(), again

    def _layer(self, hidden: torch.Tensor, cache: Optional[LayerCache] = None) -> torch.Tensor:
        hidden = hidden + self.attention(self.input_norm(hidden), cache)
        return hidden + self.mlp(self.mlp_norm(hidden))


class LlamaHead(HeadBlock):
    """GPT-2's head with an RMSNorm."""

    make_norm = staticmethod(rms_norm)


register_blocks("llama", FamilyBlocks(embedding=LlamaEmbedding, layer=LlamaLayer,
                                      head=LlamaHead, cache=True, layer_takes_id=True))
