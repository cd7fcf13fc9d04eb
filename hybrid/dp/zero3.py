"""ZeRO-3: between uses a rank holds only its shard of the weights.

Built on ZeRO-2 (``hybrid.dp.zero2``: gradients reduce-scattered per micro-batch, only the
shard kept; ``hybrid.dp.zero``: AdamW on the shard). What ZeRO-3 adds:

- each bucket's shard of the flat parameters lives in a buffer of its own (``numel/d``), the
  one AdamW steps; the bucket's full flat buffer, of which the model's parameters are views,
  has its storage freed (resized to nothing) whenever no active block uses it;
- ``StageWeights`` runs the schedule's ``UNSHARD``/``RESHARD`` actions
  (``hybrid.planning.schedules.gathers``), which open and close a stage's span (an
  ``UNSHARD`` also starts the first block its next compute needs), and hooks on each block
  of the stage: before a block's forward (a forward pre-hook) or its backward (a hook on its
  output's gradient) the block is gathered and waited for while the next one in that
  direction starts gathering; after its forward (a forward hook) or its backward (a hook on
  its input's gradient) it is released under ``after_forward``. A bucket that two blocks or
  two stages use (one that straddles them, the tied embedding of the V placement) is
  gathered once and freed with the last of them.

Autograd saved the weights a forward used: the very tensors that are freed and gathered again
in place. Their version counter is kept across the gather (the values written are the values
saved), so the backward reads the gathered weights and checks nothing falsely.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable, Iterator

import torch
from torch import nn

from hybrid.dp.buckets import Bucket
from hybrid.dp.zero import Shard
from hybrid.planning.cost.state_bytes import FP32
from hybrid.planning.schedules.gathers import AFTER_FORWARD


def _free(bucket: Bucket) -> None:
    bucket.data.untyped_storage().resize_(0)


def units_of(module: nn.Module) -> list[nn.Module]:
    """The units a stage gathers one at a time: its blocks (an ``nn.Sequential``'s children,
    a ``GPT``'s ``blocks``), else the module as one unit."""
    blocks = getattr(module, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return list(blocks)
    if isinstance(module, nn.Sequential) and len(module):
        return list(module)
    return [module]


class StageWeights:
    """The gathered state of one rank's buckets: the schedule's actions open and close a
    stage, hooks on its blocks gather and release them (see the module doc)."""

    def __init__(self, shards: list[Shard], values: list[torch.Tensor],
                 chunks: dict[int, nn.Module], policy: str, wait: Callable):
        self.shards, self.values, self.wait = shards, values, wait
        self.releases_per_use = policy == AFTER_FORWARD
        where = {id(p): s.bucket.index for s in shards for p in s.bucket.params}
        self.units = {stage: [frozenset(where[id(p)] for p in unit.parameters()
                                        if id(p) in where) for unit in units_of(module)]
                      for stage, module in chunks.items()}
        """Per stage, the buckets of each of its blocks, in forward order."""
        self.open: set[int] = set()
        self.active: set[tuple[int, int]] = set()
        self.live: set[int] = set()
        self.pending: dict[int, object] = {}
        self.peak_bytes = 0
        """The most bucket bytes gathered at once since the last ``reset_peak``."""
        self._hooks = [hook for stage, module in chunks.items()
                       for k, unit in enumerate(units_of(module))
                       for hook in (unit.register_forward_pre_hook(
                                        partial(self._before_forward, stage, k)),
                                    unit.register_forward_hook(
                                        partial(self._after_forward, stage, k)))]

    # ----- the schedule's actions ------------------------------------------------------------
    def unshard(self, stage: int, direction: int = 0) -> None:
        """``UNSHARD``: the stage's computes may gather its blocks; the first one its next
        compute needs (``direction``: +1 a forward, -1 a backward) starts gathering now."""
        self.open.add(stage)
        if direction:
            self._activate(stage, 0 if direction > 0 else len(self.units[stage]) - 1)

    def ready(self, stage: int) -> None:
        """Before a compute that needs the weights: they must be allowed to be gathered."""
        if stage not in self.open:
            raise RuntimeError(f"stage {stage} computes with parallel.zero=3 but its weights "
                               f"are not gathered: its schedule lacks {stage}UNSHARD (make the "
                               f"rank's list with schedules.gathers.add_gathers)")

    def reshard(self, stage: int) -> None:
        """``RESHARD``: release every block of the stage."""
        self.open.discard(stage)
        self._deactivate({(stage, k) for k in range(len(self.units[stage]))})

    # ----- the blocks' hooks -----------------------------------------------------------------
    def _before_forward(self, stage: int, k: int, module, args) -> None:
        self._enter(stage, k, +1)

    def _after_forward(self, stage: int, k: int, module, args, output) -> None:
        self._leave(stage, k)
        if not torch.is_grad_enabled():
            return
        if k == len(self.units[stage]) - 1 and output.requires_grad:
            output.register_hook(lambda grad: self._enter(stage, k, -1))
        if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(lambda grad: self._handed_back(stage, k))

    def _handed_back(self, stage: int, k: int) -> None:
        """Block ``k``'s input gradient is made: its backward is done, the previous one's
        starts."""
        self._leave(stage, k)
        if k > 0:
            self._enter(stage, k - 1, -1)

    def _enter(self, stage: int, k: int, direction: int) -> None:
        """Block ``k`` gathered and waited for; the next in ``direction`` starts gathering."""
        self._activate(stage, k)
        nxt = k + direction
        if 0 <= nxt < len(self.units[stage]):
            self._activate(stage, nxt)
        for index in self.units[stage][k]:
            self._settle(index)

    def _leave(self, stage: int, k: int) -> None:
        if self.releases_per_use:
            self._deactivate({(stage, k)})

    # ----- buckets ---------------------------------------------------------------------------
    def _activate(self, stage: int, k: int) -> None:
        if stage not in self.open:
            raise RuntimeError(f"stage {stage}'s block {k} computes outside its UNSHARD .. "
                               f"RESHARD span; run the stage through the schedule's actions")
        self.active.add((stage, k))
        for index in sorted(self.units[stage][k] - self.live):
            self._gather(index)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())

    def _deactivate(self, units: set[tuple[int, int]]) -> None:
        self.active -= units
        still = set().union(*(self.units[s][k] for s, k in self.active))
        for index in sorted(self.live - still):
            self._settle(index)
            _free(self.shards[index].bucket)
            self.live.discard(index)

    def live_bytes(self) -> int:
        return sum(FP32 * self.shards[i].bucket.numel for i in self.live)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes()

    def _gather(self, index: int) -> None:
        bucket, shard = self.shards[index].bucket, self.values[index]
        bucket.data.untyped_storage().resize_(bucket.numel * bucket.data.element_size())
        self.live.add(index)
        # Autograd's saved weights are these tensors: what the gather writes is what was
        # saved, so the version the backward checks must not move.
        with torch.autograd._unsafe_preserve_version_counter(bucket.data):
            group = bucket.shard_group  # dp x cp for dense weights, expert-DP for experts
            if group.size() == 1:
                bucket.data.copy_(shard)
            else:
                self.pending[index] = group.all_gather_into(bucket.data, shard, async_op=True)

    def _settle(self, index: int) -> None:
        work = self.pending.pop(index, None)
        if work is not None:
            self.wait(work)

    @contextlib.contextmanager
    def whole(self, write_back: bool = False) -> Iterator[None]:
        """Every bucket gathered for the duration (a checkpoint's save or load); with
        ``write_back`` the loaded values then replace the shards."""
        stages = [s for s in self.units if s not in self.open]
        units = {(s, k) for s in stages for k in range(len(self.units[s]))}
        self.open.update(stages)
        for stage, k in sorted(units):
            self._activate(stage, k)
        for index in list(self.pending):
            self._settle(index)
        try:
            yield
            if write_back:
                for shard, values in zip(self.shards, self.values):
                    values.copy_(shard.bucket.data[shard.start:shard.end])
        finally:
            self.open.difference_update(stages)
            self._deactivate(units)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def shard_values(shards: list[Shard]) -> list[torch.Tensor]:
    """Each bucket's shard of its flat parameters, in a buffer of its own; the full buffers
    are then freed (the model's parameters, views of them, hold no memory until gathered)."""
    values = [s.bucket.data[s.start:s.end].clone() for s in shards]
    for shard in shards:
        _free(shard.bucket)
    return values
