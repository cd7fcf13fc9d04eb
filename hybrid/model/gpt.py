"""A decoder of any registered family as a plain list of blocks, and the 1-process / pp=1
model that holds them all (its blocks from ``hybrid.model.families``, by ``model.family``).

Block 0 is the embedding, blocks 1..L the transformer layers, block L+1 the head. A pipeline
partitioner builds only the blocks of its stages (``build_blocks(..., block_ids=...)``); there
is no pipeline plumbing in here. Each block's weights come from its own RNG stream,
``block_seed(seed, block_id)``, so they are the same whichever other blocks a rank builds and
whatever the TP size (a shard is a slice of the 1-process weight).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from hybrid.planning.config import ModelConfig
from hybrid.groups import ParallelGroups
from hybrid.planning.layout import LayoutError
from hybrid.model.blocks import Context
from hybrid.model.families import family_blocks
from hybrid.model.kv_cache import KVCache
from hybrid.model.cross_entropy import vocab_parallel_cross_entropy
from hybrid.model.inputs import validate_batch_across
from hybrid.planning.params import block_param_specs
from hybrid.planning.validate import check_model_shape

_SEED_STRIDE = 1_000_003  # a prime larger than any block count: streams never collide


def num_blocks(cfg: ModelConfig) -> int:
    """Embedding + ``cfg.layers`` transformer layers + head."""
    return cfg.layers + 2


def block_seed(seed: int, block_id: int) -> int:
    return seed * _SEED_STRIDE + block_id


def block_generator(seed: int, block_id: int) -> torch.Generator:
    """The CPU generator that initialises block ``block_id`` (megatron initialises on CPU)."""
    return torch.Generator(device="cpu").manual_seed(block_seed(seed, block_id))


def _checked_block_ids(cfg: ModelConfig, block_ids: Optional[Sequence[int]]) -> list[int]:
    total = num_blocks(cfg)
    if block_ids is None:
        return list(range(total))
    ids = list(block_ids)
    if ids != sorted(set(ids)) or any(not 0 <= i < total for i in ids):
        raise ValueError(f"block_ids={ids} must be increasing, distinct and within "
                         f"0..{total - 1} (embedding, {cfg.layers} layers, head)")
    return ids


def build_blocks(cfg: ModelConfig, groups: ParallelGroups, *, seed: int,
                 block_ids: Optional[Sequence[int]] = None,
                 sequence_parallel: bool = False, cp_comm: str = "p2p") -> list[nn.Module]:
    """Build the requested blocks (all if None), in order, on ``groups.device``.

    Sharded over ``groups.tensor``. With tied embeddings, a head built together with the embedding
    shares its Parameter; a head built without it gets its own copy (see ``HeadBlock``).
    ``sequence_parallel`` is ignored at tp=1; at cp > 1 the embedding and attention work on this
rank's chunks of each sequence (``hybrid.model.context``). Every parameter gets its ``ParamSpec`` as
    ``param.spec`` (``hybrid.planning.params``): its one identity, whatever the layout.
    """
    check_model_shape(cfg, groups.layout.tp)
    tp_group, last = groups.tensor, num_blocks(cfg) - 1
    sequence_parallel = sequence_parallel and groups.layout.tp > 1
    blocks: list[nn.Module] = []
    embedding: Optional[nn.Module] = None
    family = family_blocks(cfg)
    context = Context(groups.context, cp_comm) if groups.layout.cp > 1 else Context()
    for block_id in _checked_block_ids(cfg, block_ids):
        generator = block_generator(seed, block_id)
        common = dict(generator=generator, sequence_parallel=sequence_parallel)
        if block_id == 0:
            block = embedding = family.embedding(cfg, tp_group, **common, context=context)
        elif block_id == last:
            block = family.head(cfg, tp_group, **common, embedding=embedding,
                                embedding_generator=block_generator(seed, 0))
        else:
            place = {"block_id": block_id} if family.layer_takes_id else {}
            if cfg.moe.experts and family.layer_takes_id:  # MoE layers: experts spread over ep
                place["expert_group"] = groups.expert
            block = family.layer(cfg, tp_group, **common, context=context, **place)
        block.block_id = block_id
        attach_specs(block, block_param_specs(cfg, block_id, sequence_parallel=sequence_parallel),
                     groups.layout.tp, groups.layout.ep)
        blocks.append(block.to(groups.device))
    return blocks


def attach_specs(block: nn.Module, specs: dict, tp: int, ep: int = 1) -> None:
    """Give every parameter of ``block`` its spec, checking that the block built exactly the
    parameters, with exactly the shard shapes, that the spec table describes."""
    named = dict(block.named_parameters(remove_duplicate=False))
    if list(named) != list(specs):  # the order too: hybrid.planning.cost.state_bytes lays buckets out by it
        raise AssertionError(f"block {block.block_id} has parameters {list(named)}, its "
                             f"specs describe {list(specs)}")
    for local_name, param in named.items():
        spec = specs[local_name]
        if tuple(param.shape) != spec.local_shape(tp, ep):
            raise AssertionError(f"{spec.name}: built {tuple(param.shape)}, the spec says "
                                 f"{spec.local_shape(tp, ep)} at tp={tp} ep={ep}")
        param.spec = spec


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, groups: ParallelGroups,
            vocab: int) -> torch.Tensor:
    """Mean token cross-entropy (fp32 scalar) of vocab-parallel logits ``[s, b, V/tp]``
    against ``labels`` ``[b, s]`` over the real ``vocab`` (padding columns masked); identical
    on every TP rank."""
    labels_sb = labels.t().contiguous()  # [s, b], the logits' layout
    return vocab_parallel_cross_entropy(logits, labels_sb, groups.tensor, vocab).mean()


class GPT(nn.Module):
    """All blocks in one module: the 1-process reference model, and the model for pp=1."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, *, seed: int,
                 sequence_parallel: bool = False, cp_comm: str = "p2p"):
        super().__init__()
        if groups.layout.pp != 1:
            raise LayoutError(f"GPT holds every block, so it needs pp=1, got "
                              f"{groups.layout.describe()}; use build_blocks per pipeline stage")
        self.cfg, self.groups = cfg, groups
        self.sequence_parallel = sequence_parallel and groups.layout.tp > 1
        self.blocks = nn.ModuleList(build_blocks(cfg, groups, seed=seed,
                                                 sequence_parallel=sequence_parallel,
                                                 cp_comm=cp_comm))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean loss over the micro-batch; every TP rank validates it before communicating."""
        shards = self.groups.layout.tp if self.sequence_parallel else 1
        validate_batch_across(tokens, labels, self.cfg, self.groups.tensor,
                              sequence_shards=shards)
        hidden = tokens
        for block in self.blocks:
            hidden = block(hidden)
        return lm_loss(hidden, labels, self.groups, self.cfg.vocab)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """``[b, vocab]`` logits of the last of ``tokens`` ``[b, s]``, the tokens that follow
        those in ``cache`` (empty: a prompt; else one token), which keeps their keys and
        values (one process, families whose blocks take a cache: ``FamilyBlocks.cache``)."""
        if self.groups.layout.tp != 1 or self.groups.layout.cp != 1:
            raise LayoutError("GPT.decode runs on one process: use it at tp=1, cp=1")
        hidden = self.blocks[0](tokens, cache=cache)
        for block, layer_cache in zip(self.blocks[1:-1], cache.layers):
            hidden = block(hidden, cache=layer_cache)
        cache.length += tokens.shape[1]
        return self.blocks[-1](hidden)[-1, :, :self.cfg.vocab]

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[b, s, vocab]`` logits of the real vocabulary (one process: tp=1, where this
        rank holds every column)."""
        if self.groups.layout.tp != 1:
            raise LayoutError("GPT.logits gathers no vocabulary shards: use it at tp=1")
        hidden = tokens
        for block in self.blocks:
            hidden = block(hidden)
        return hidden[..., :self.cfg.vocab].transpose(0, 1)
