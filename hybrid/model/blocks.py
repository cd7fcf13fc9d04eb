"""The three kinds of GPT-2 block: embedding, transformer layer, head (the family ``gpt2``'s
torch side, registered in ``hybrid.model.families``).

Shapes (Megatron's, sequence first): tokens ``[b, s]`` int64; activations ``[s, b, h]``, or
``[s/tp, b, h]`` with sequence parallelism; logits ``[s, b, V/tp]``; under context parallelism
``s`` is the rank's share of the sequence (``hybrid.model.context``) (vocab-parallel, ``V`` the
padded vocabulary). Every block draws its weights from the ``torch.Generator`` it is given, in a
fixed order, and megatron's CPU initialisation draws each full matrix before slicing it, so a
shard's values do not depend on the TP size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybrid.comm import Group
from hybrid.planning.config import ModelConfig
from hybrid.model.context import context_attention, context_positions
from hybrid.model.families import FamilyBlocks, register_blocks
from hybrid.model.kv_cache import KVCache, LayerCache
from hybrid.model.megatron_adapter import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from hybrid.model.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)


def normal_init(std: float, generator: torch.Generator) -> Callable[[torch.Tensor], None]:
    def init(tensor: torch.Tensor) -> None:
        nn.init.normal_(tensor, mean=0.0, std=std, generator=generator)
    return init


def output_init(cfg: ModelConfig, generator: torch.Generator) -> Callable[[torch.Tensor], None]:
    # GPT-2 / Megatron: layers that write into the residual stream start smaller, so the
    # stream's variance does not grow with depth.
    return normal_init(cfg.init_std / math.sqrt(2.0 * cfg.layers), generator)


def layer_norm(cfg: ModelConfig) -> nn.LayerNorm:
    # Under sequence parallelism a norm sees only this rank's tokens, so its gradient is a
    # partial sum over TP: its ParamSpec (hybrid.planning.params) says so.
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)


def word_embedding(cfg: ModelConfig, tp_group: Group,
                   generator: torch.Generator) -> VocabParallelEmbedding:
    return VocabParallelEmbedding(cfg.padded_vocab, cfg.hidden, tp_group=tp_group,
                                  init_method=normal_init(cfg.init_std, generator))


@dataclass(frozen=True)
class Context:
    """How a block sees context parallelism: its group (size 1: off) and how keys and values
    cross it (``parallel.cp_comm``)."""

    group: Optional[Group] = None
    comm: str = "p2p"

    @property
    def on(self) -> bool:
        return self.group is not None and self.group.size() > 1


class EmbeddingBlock(nn.Module):
    """Token + learned position embedding: tokens ``[b, s]`` -> ``[s(/tp), b, h]``; under
    context parallelism ``s`` is this rank's chunks, at their positions in the sequence."""

    def __init__(self, cfg: ModelConfig, tp_group: Group, *,
                 generator: torch.Generator, sequence_parallel: bool,
                 context: Context = Context()):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.context = context
        self.word_embeddings = word_embedding(cfg, tp_group, generator)  # draws first
        self.position_embeddings = nn.Parameter(torch.empty(cfg.seq_len, cfg.hidden))
        normal_init(cfg.init_std, generator)(self.position_embeddings.data)

    def forward(self, tokens: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        seq = tokens.shape[1]
        hidden = self.word_embeddings(tokens.t())  # [s, b, h], all-reduced over TP
        if self.context.on:
            group = self.context.group
            where = context_positions(seq, group.size(), group.rank(), tokens.device)
            hidden = hidden + self.position_embeddings[where].unsqueeze(1)
        else:  # generating with a cache, the tokens follow the cached ones
            start = 0 if cache is None else cache.length
            hidden = hidden + self.position_embeddings[start:start + seq].unsqueeze(1)
        if self.sequence_parallel:
            # After the add, so the position table's gradient is complete on every rank.
            hidden = scatter_to_sequence_parallel_region(hidden, self.tp_group)
        return hidden


class SelfAttention(nn.Module):
    """Causal multi-head self-attention; QKV columns laid out ``[heads, 3, head_dim]``.

    That layout puts each head's q, k and v side by side, so a contiguous TP slice of the
    output dimension holds whole heads, and the 1-process model uses the same layout.
    """

    def __init__(self, cfg: ModelConfig, tp_group: Group, *,
                 generator: torch.Generator, sequence_parallel: bool,
                 context: Context = Context()):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.context = context
        # Context-parallel attention keeps no scores for backward (it recomputes them), so
        # selective recompute has nothing left to save there.
        self.recompute_core = cfg.recompute == "selective" and not context.on
        self.head_dim = cfg.hidden // cfg.heads
        self.local_heads = cfg.heads // tp_group.size()
        self.qkv = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, tp_group=tp_group,
                                        init_method=normal_init(cfg.init_std, generator),
                                        bias=True, input_is_gathered=sequence_parallel)
        self.proj = RowParallelLinear(cfg.hidden, cfg.hidden, tp_group=tp_group,
                                      init_method=output_init(cfg, generator), bias=True,
                                      output_sequence_parallel=sequence_parallel)

    def forward(self, hidden: torch.Tensor, cache: Optional[LayerCache] = None) -> torch.Tensor:
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group)
        seq, batch = hidden.shape[:2]
        qkv = self.qkv(hidden).view(seq, batch, self.local_heads, 3, self.head_dim)
        # [s, b, n, hd] -> [b, n, s, hd], the layout scaled_dot_product_attention expects.
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.unbind(dim=3))
        if cache is not None:
            return self.proj(cache.attend(q, k, v))
        return self.proj(causal_attention(q, k, v, self.context, self.recompute_core))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: Context,
                     recompute_core: bool) -> torch.Tensor:
    """Causal attention of ``[b, n, s, hd]`` heads -> ``[s, b, n * hd]``: around the context
    group's ring when it is on, else the fused kernel (recomputed in the backward under
    selective recompute)."""
    if context.on:
        return context_attention(q, k, v, context.group, comm=context.comm)
    if recompute_core and torch.is_grad_enabled():
        # Selective recompute: the attention core keeps nothing for backward but its
        # inputs (which the QKV projection's output already holds) and runs again there.
        return checkpoint(_attention_core, q, k, v, use_reentrant=False)
    return _attention_core(q, k, v)


def _attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``[b, n, s, hd]`` heads -> ``[s, b, n * hd]``."""
    context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    batch, _, seq, _ = context.shape
    return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> GELU -> h (row-parallel)."""

    def __init__(self, cfg: ModelConfig, tp_group: Group, *,
                 generator: torch.Generator, sequence_parallel: bool):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.fc1 = ColumnParallelLinear(cfg.hidden, cfg.ffn, tp_group=tp_group,
                                        init_method=normal_init(cfg.init_std, generator),
                                        bias=True, input_is_gathered=sequence_parallel)
        self.fc2 = RowParallelLinear(cfg.ffn, cfg.hidden, tp_group=tp_group,
                                     init_method=output_init(cfg, generator), bias=True,
                                     output_sequence_parallel=sequence_parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group)
        return self.fc2(F.gelu(self.fc1(hidden), approximate="tanh"))


class TransformerLayer(nn.Module):
    """Pre-norm layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``[s,b,h]`` -> same."""

    def __init__(self, cfg: ModelConfig, tp_group: Group, *,
                 generator: torch.Generator, sequence_parallel: bool,
                 context: Context = Context()):
        super().__init__()
        self.recompute = cfg.recompute == "full"
        self.input_norm = layer_norm(cfg)
        self.attention = SelfAttention(cfg, tp_group, generator=generator,
                                       sequence_parallel=sequence_parallel, context=context)
        self.mlp_norm = layer_norm(cfg)
        self.mlp = MLP(cfg, tp_group, generator=generator, sequence_parallel=sequence_parallel)

    def forward(self, hidden: torch.Tensor, cache: Optional[LayerCache] = None) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            # Keep only the layer input; the backward re-runs the forward (and its TP
            # collectives, in the same order on every TP rank).
            return checkpoint(self._layer, hidden, use_reentrant=False)
        return self._layer(hidden, cache)

    def _layer(self, hidden: torch.Tensor, cache: Optional[LayerCache] = None) -> torch.Tensor:
        hidden = hidden + self.attention(self.input_norm(hidden), cache)
        return hidden + self.mlp(self.mlp_norm(hidden))


class HeadBlock(nn.Module):
    """Final norm + output layer: ``[s(/tp), b, h]`` -> vocab-parallel logits ``[s, b, V/tp]``.

    With tied embeddings the output layer uses ``word_embeddings_weight``: the embedding
    block's own Parameter when this rank built it, else a copy drawn from the embedding block's
    RNG stream (``embedding_generator``); its spec is the embedding's (``tied``), so the
    gradient sync sums it with the embedding over ``groups.embedding``.
    """

    make_norm = staticmethod(layer_norm)
    """The final norm's constructor (a family's head may use another norm)."""

    def __init__(self, cfg: ModelConfig, tp_group: Group, *,
                 generator: torch.Generator, sequence_parallel: bool,
                 embedding: Optional[EmbeddingBlock] = None,
                 embedding_generator: Optional[torch.Generator] = None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.tied = cfg.tie_embeddings
        self.final_norm = self.make_norm(cfg)
        if self.tied:
            if embedding is not None:
                self.word_embeddings_weight = embedding.word_embeddings.weight
            else:
                assert embedding_generator is not None, "tied head needs the embedding's RNG"
                own = word_embedding(cfg, tp_group, embedding_generator).weight
                self.word_embeddings_weight = own
        self.output_layer = ColumnParallelLinear(
            cfg.hidden, cfg.padded_vocab, tp_group=tp_group,
            init_method=normal_init(cfg.init_std, generator), bias=False,
            input_is_gathered=sequence_parallel, shared_weight=self.tied)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.final_norm(hidden)
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group)
        weight = self.word_embeddings_weight if self.tied else None
        return self.output_layer(hidden, weight)


register_blocks("gpt2", FamilyBlocks(embedding=EmbeddingBlock, layer=TransformerLayer,
                                     head=HeadBlock, cache=True))
