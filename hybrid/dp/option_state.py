"""What a reduction keeps between steps, as checkpoint tensors of this rank's own.

PowerSGD's error feedback is this DP rank's, and its warm-start ``Q`` and a delayed step's
mean in flight belong to this TP rank's shards and bucket layout: none of it is a slice of a
global tensor that another layout could re-cut. So each rank saves its own, under
``dp_option.tp{t}.dp{d}.`` + the reduction's own keys (``checkpoint_state``; parameter names
tell the pipeline stages apart), and a resume loads it only on the same layout and settings
(``same_option_layout``: the layout, the buckets, the ZeRO stage and the fields the
reduction's spec names); elsewhere the reduction starts afresh (PowerSGD: zero error and a new
``Q``; a delay: no mean in flight, so the first step after the resume applies none), which the
checkpointer says in one line.
"""

from __future__ import annotations

import torch

from hybrid.planning.config import ParallelConfig, from_dict
from hybrid.planning.layout import COORD_ORDER
from hybrid.planning.strategies import DpOptions, reduction_of

PREFIX = "dp_option."
MATCHING = (*COORD_ORDER, "vpp", "bucket_mb", "zero")


def option_tag(sync) -> str:
    """The prefix of this rank's option state keys (its TP rank and DP shard)."""
    return f"{PREFIX}tp{sync.groups.tp_rank}.dp{sync.groups.sharding.rank()}."


def _name_of(sync):
    return lambda bucket, slot: sync.specs[id(sync.buckets[bucket].params[slot])].name


def option_state(sync) -> dict[str, torch.Tensor]:
    """This rank's reduction state, by checkpoint key (a delayed mean is waited for)."""
    tag = option_tag(sync)
    return {tag + key: t for key, t in sync.reducer.checkpoint_state(_name_of(sync)).items()}


def option_targets(sync) -> dict[str, torch.Tensor]:
    """Tensors to load ``option_state`` into (``load_option_state`` then takes them)."""
    tag = option_tag(sync)
    return {tag + key: t for key, t in sync.reducer.checkpoint_targets(_name_of(sync)).items()}


def load_option_state(sync, targets: dict[str, torch.Tensor]) -> None:
    tag = option_tag(sync)
    mine = {key[len(tag):]: t for key, t in targets.items() if key.startswith(tag)}
    if mine:
        sync.reducer.load_checkpoint_state(mine, _name_of(sync))


def same_option_layout(saved_config: dict, cfg) -> bool:
    """Whether a checkpoint's reduction state fits this run (same layout and settings)."""
    saved = from_dict(saved_config["parallel"], ParallelConfig)  # flat keys of before too
    spec = reduction_of(DpOptions.of(cfg.parallel))
    fields = MATCHING + spec.checkpoint_fields
    return all(getattr(saved, k) == getattr(cfg.parallel, k) for k in fields)
