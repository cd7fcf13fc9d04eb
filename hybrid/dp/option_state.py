"""What a DP option keeps between steps, as checkpoint tensors of this rank's own.

PowerSGD's error feedback is this DP rank's, and its warm-start ``Q`` and a delayed step's
mean in flight belong to this TP rank's shards and bucket layout: none of it is a slice of a
global tensor that another layout could re-cut. So each rank saves its own, under
``dp_option.tp{t}.dp{d}.`` + what (parameter names tell the pipeline stages apart), and a
resume loads it only on the same layout and options (``same_option_layout``); elsewhere the
option starts afresh (PowerSGD: zero error and a new ``Q``; a delay: no mean in flight, so the
first step after the resume applies none), which the checkpointer says in one line.
"""

from __future__ import annotations

import torch

PREFIX = "dp_option."
MATCHING = ("dp", "tp", "pp", "vpp")
MATCHING_PARALLEL = ("bucket_mb", "zero", "dp_compress", "powersgd_rank", "dp_delay")


def _tag(sync) -> str:
    return f"{PREFIX}tp{sync.groups.tp_rank}.dp{sync.dp_rank}."


def _name_of(sync):
    return lambda bucket, slot: sync.specs[id(sync.buckets[bucket].params[slot])].name


def option_state(sync) -> dict[str, torch.Tensor]:
    """This rank's DP option state, by checkpoint key (a delayed mean is waited for)."""
    tag = _tag(sync)
    if hasattr(sync.reducer, "matrices"):
        return {tag + key: t for key, t in sync.reducer.state_dict(_name_of(sync)).items()}
    if sync.delayed is not None:
        return {f"{tag}delayed.{i}": t for i, t in enumerate(sync.delayed.settled(sync.wait))}
    return {}


def option_targets(sync) -> dict[str, torch.Tensor]:
    """Tensors to load ``option_state`` into (``load_option_state`` then takes them)."""
    tag = _tag(sync)
    if hasattr(sync.reducer, "matrices"):
        return {tag + key: torch.zeros_like(t)
                for key, t in sync.reducer.state_dict(_name_of(sync)).items()}
    if sync.delayed is not None:
        return {f"{tag}delayed.{i}": torch.zeros_like(b.grad)
                for i, b in enumerate(sync.buckets)}
    return {}


def load_option_state(sync, targets: dict[str, torch.Tensor]) -> None:
    tag = _tag(sync)
    mine = {key[len(tag):]: t for key, t in targets.items() if key.startswith(tag)}
    if hasattr(sync.reducer, "matrices"):
        sync.reducer.load_state_dict(mine, _name_of(sync))
    elif sync.delayed is not None:
        sync.delayed.load([mine[f"delayed.{i}"] for i in range(len(sync.buckets))])


def same_option_layout(saved_config: dict, cfg) -> bool:
    """Whether a checkpoint's DP option state fits this run (same layout and options)."""
    saved = saved_config["parallel"]
    return all(saved.get(k) == getattr(cfg.parallel, k) for k in MATCHING + MATCHING_PARALLEL)
