"""ZeRO-3: between uses a rank holds only its shard of the weights.

Built on ZeRO-2 (``hybrid.dp.zero2``: gradients reduce-scattered per micro-batch, only the
shard kept; ``hybrid.dp.zero``: AdamW on the shard). What ZeRO-3 adds:

- each bucket's shard of the flat parameters lives in a buffer of its own (``numel/d``), the
  one AdamW steps; the bucket's full flat buffer, of which the model's parameters are views,
  has its storage freed (resized to nothing) whenever no stage needs it;
- ``StageWeights`` runs the schedule's ``UNSHARD``/``RESHARD`` actions
  (``hybrid.planning.schedules.gathers``): ``unshard(stage)`` gives back the storage of the
  stage's buckets and starts their all-gathers from the shards, ``ready(stage)`` waits for them
  before a compute that needs the weights, ``reshard(stage)`` frees the buckets no gathered
  stage still uses. A bucket shared by two stages (one that straddles a chunk boundary, the
  tied embedding of the V placement) is gathered once and freed with its last stage.

Autograd saved the weights a forward used: the very tensors that are freed and gathered again
in place. Their version counter is kept across the gather (the values written are the values
saved), so the backward reads the gathered weights and checks nothing falsely.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from hybrid.comm import Group
from hybrid.dp.buckets import Bucket
from hybrid.dp.zero import Shard
from hybrid.planning.cost.state_bytes import FP32


def _free(bucket: Bucket) -> None:
    bucket.data.untyped_storage().resize_(0)


class StageWeights:
    """The gathered state of one rank's buckets, driven by the schedule's gather actions."""

    def __init__(self, shards: list[Shard], values: list[torch.Tensor],
                 stage_buckets: dict[int, frozenset[int]], group: Group, wait: Callable):
        self.shards, self.values, self.group, self.wait = shards, values, group, wait
        self.stage_buckets = stage_buckets
        self.gathered: set[int] = set()
        self.live: set[int] = set()
        self.pending: dict[int, object] = {}
        self.peak_bytes = 0
        """The most bucket bytes gathered at once since the last ``reset_peak``."""

    def unshard(self, stage: int) -> None:
        self.gathered.add(stage)
        for index in sorted(self.stage_buckets[stage] - self.live):
            self._gather(index)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())

    def ready(self, stage: int) -> None:
        """Wait for the stage's gathers; a compute must not run on released weights."""
        if stage not in self.gathered:
            raise RuntimeError(f"stage {stage} computes with parallel.zero=3 but its weights "
                               f"are not gathered: its schedule lacks {stage}UNSHARD (make the "
                               f"rank's list with schedules.gathers.add_gathers)")
        for index in self.stage_buckets[stage]:
            self._settle(index)

    def reshard(self, stage: int) -> None:
        self.gathered.discard(stage)
        still = set().union(*(self.stage_buckets[s] for s in self.gathered))
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
            if self.group.size() == 1:
                bucket.data.copy_(shard)
            else:
                self.pending[index] = self.group.all_gather_into(bucket.data, shard,
                                                                 async_op=True)

    def _settle(self, index: int) -> None:
        work = self.pending.pop(index, None)
        if work is not None:
            self.wait(work)

    @contextlib.contextmanager
    def whole(self, write_back: bool = False) -> Iterator[None]:
        """Every bucket gathered for the duration (a checkpoint's save or load); with
        ``write_back`` the loaded values then replace the shards."""
        stages = [s for s in self.stage_buckets if s not in self.gathered]
        for stage in stages:
            self.unshard(stage)
        for stage in stages:
            self.ready(stage)
        try:
            yield
            if write_back:
                for shard, values in zip(self.shards, self.values):
                    values.copy_(shard.bucket.data[shard.start:shard.end])
        finally:
            for stage in stages:
                self.reshard(stage)


def shard_values(shards: list[Shard]) -> list[torch.Tensor]:
    """Each bucket's shard of its flat parameters, in a buffer of its own; the full buffers
    are then freed (the model's parameters, views of them, hold no memory until gathered)."""
    values = [s.bucket.data[s.start:s.end].clone() for s in shards]
    for shard in shards:
        _free(shard.bucket)
    return values


def stage_buckets(buckets: list[Bucket], chunks: dict[int, nn.Module]
                  ) -> dict[int, frozenset[int]]:
    """The buckets each stage's parameters lie in."""
    where = {id(p): b.index for b in buckets for p in b.params}
    return {stage: frozenset(where[id(p)] for p in module.parameters() if id(p) in where)
            for stage, module in chunks.items()}


def make_stage_weights(shards: list[Shard], values: list[torch.Tensor],
                       chunks: dict[int, nn.Module], group: Group,
                       wait: Callable) -> Optional[StageWeights]:
    return StageWeights(shards, values, stage_buckets([s.bucket for s in shards], chunks),
                        group, wait)
