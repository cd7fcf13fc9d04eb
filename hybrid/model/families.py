"""The torch side of the model registry: each family's three block constructors, keyed by
``model.family`` like its pure spec (``hybrid.planning.models``).

A family's blocks are the same frame for every family (the pipeline partitions it): block 0
the embedding, blocks 1..L the layers, block L+1 the head, each a ``torch.nn.Module`` whose
``named_parameters()`` are exactly its spec's table, in order (``hybrid.model.gpt`` checks).
The constructors take what ``EmbeddingBlock``, ``TransformerLayer`` and ``HeadBlock`` take
(``hybrid.model.blocks``, GPT-2's): ``(cfg, tp_group, *, generator, sequence_parallel,
context)``; the head ``embedding`` and ``embedding_generator`` instead of ``context``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from hybrid.planning.models import model_spec


@dataclass(frozen=True)
class FamilyBlocks:
    """One family's block constructors."""

    embedding: Callable
    layer: Callable
    head: Callable
    cache: bool = False
    """Whether the embedding and the layers take a ``cache`` (``hybrid.model.kv_cache``) in
    their forward, for generation; else ``hybrid-generate`` recomputes the whole prefix."""
    layer_takes_id: bool = False
    """Whether the layer constructor takes ``block_id`` (its place 1..L: Llama's MoE layers
    are every ``moe.every``-th)."""


BLOCKS: dict[str, FamilyBlocks] = {}
"""The registered families' blocks by family name."""


def register_blocks(family: str, blocks: FamilyBlocks) -> FamilyBlocks:
    """Make ``family``'s blocks known (again, if its module is imported twice)."""
    BLOCKS[family] = blocks
    return blocks


def family_blocks(cfg) -> FamilyBlocks:
    """The blocks of ``cfg.family``, importing the spec's ``blocks_module`` (which registers
    them) on first use."""
    spec = model_spec(cfg)
    if spec.name not in BLOCKS:
        importlib.import_module(spec.blocks_module)
    if spec.name not in BLOCKS:
        raise AssertionError(f"model family {spec.name!r}: importing {spec.blocks_module} "
                             f"registered no blocks (hybrid.model.families.register_blocks)")
    return BLOCKS[spec.name]
