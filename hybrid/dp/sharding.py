"""The sharding strategies at run time: what ``parallel.zero`` changes in ``GradSync``.

Each class is the runtime of one spec in ``hybrid.planning.strategies.zero`` (which holds what
it keeps and sends, checked against these): how the gradient buckets are laid out, whether the
optimizer steps whole parameters or this rank's shard of each bucket, where a reduced gradient
lands, and what follows the optimizer step. ``GradSync`` asks, never branches on the stage.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from hybrid.dp.buckets import Bucket, Piece
from hybrid.dp.zero import Shard, all_gather_params
from hybrid.dp.zero2 import StagedShards
from hybrid.dp.zero3 import StageWeights, shard_values


class Replicated:
    """ZeRO stage 0: every DP rank keeps whole gradients and optimizer state."""

    pads = False
    """Buckets padded to a multiple of the group size (shards of equal size)."""
    keeps_grad_buffer = True
    """A persistent gradient buffer per bucket (``.grad`` are views of it)."""
    flattens = False
    """Parameters become views of one flat buffer per bucket (updated by an all-gather)."""
    shards_state = False
    """Each rank holds only its shard of the reduced gradients and of AdamW's state."""

    def __init__(self, wait: Callable):
        self.wait = wait
        self.shards: list[Shard] = []

    def make_shards(self, buckets: list[Bucket]) -> list[Shard]:
        return self.shards

    def pieces(self, buckets: list[Bucket], decays: Callable, in_norm: Callable
               ) -> list[list[Piece]]:
        """What the optimizer steps, per bucket: the parameters themselves."""
        return [[Piece(tensor=p, grad=p.grad, param=p, offset=0, decays=decays(p),
                       counts_in_norm=in_norm(p)) for p in bucket.params]
                for bucket in buckets]

    def grad_buffers(self, buckets: list[Bucket]) -> list[torch.Tensor]:
        """The buffers that hold this rank's reduced gradients (what clipping scales)."""
        return [b.grad for b in buckets]

    def shard_of(self, bucket: Bucket) -> Optional[Shard]:
        """Where the bucket's mean lands under sharding (None: in the bucket itself)."""
        return None

    def accumulated(self, bucket: Bucket, slot: int, param: torch.Tensor) -> bool:
        """A parameter's gradient arrived; True when this strategy took it over."""
        return False

    def flush(self) -> bool:
        """End of the backward; True when this strategy finished the reduction itself."""
        return False

    def pad_rounds(self, rounds: int, own: int = 1) -> None:
        """This step other replicas run ``rounds`` micro-batches more than this one's ``own``
        (``parallel.dp_balance=dynamic``): a strategy that communicates per micro-batch
        takes part in theirs."""

    def after_optimizer_step(self) -> None:
        """What follows AdamW's step (a sharded strategy gathers the updated parameters)."""

    def stage_weights(self, chunks: dict, policy: str) -> Optional[StageWeights]:
        """What runs the schedule's gathers and releases (ZeRO-3), or None."""
        return None

    def close(self) -> None:
        """Remove what it hooked into the model."""

    def held_weights(self) -> list[torch.Tensor]:
        """Weight buffers held besides the model's parameters (ZeRO-3's shards)."""
        return []


class Zero1(Replicated):
    """ZeRO-1: AdamW's state sharded over the gradient group (``hybrid.dp.zero``)."""

    pads = flattens = shards_state = True

    def make_shards(self, buckets):
        self.shards = [Shard.of(b, b.shard_group.rank(), b.shard_group.size())
                       for b in buckets]
        return self.shards

    def pieces(self, buckets, decays, in_norm):
        """The slices of each bucket's parameters inside this rank's shard."""
        return [shard.pieces(decays, in_norm) for shard in self.shards]

    def grad_buffers(self, buckets):
        return [s.grad for s in self.shards]

    def shard_of(self, bucket):
        return self.shards[bucket.index]

    def after_optimizer_step(self):
        all_gather_params(self.shards, self.wait)  # each over its bucket's sharding group


class Zero2(Zero1):
    """ZeRO-2: between steps only the shard of the gradients (``hybrid.dp.zero2``)."""

    keeps_grad_buffer = False

    def make_shards(self, buckets):
        shards = super().make_shards(buckets)
        self.staged = StagedShards(shards, self.wait)
        return shards

    def accumulated(self, bucket, slot, param):
        self.staged.accumulated(bucket, slot, param)
        return True

    def flush(self):
        self.staged.flush()
        return True

    def pad_rounds(self, rounds, own=1):
        self.staged.extra_rounds, self.staged.own_rounds = rounds, own


class Zero3(Zero2):
    """ZeRO-3: between uses only the shard of the weights (``hybrid.dp.zero3``)."""

    def make_shards(self, buckets):
        shards = super().make_shards(buckets)
        self.values = shard_values(shards)
        self.weights: Optional[StageWeights] = None
        return shards

    def pieces(self, buckets, decays, in_norm):
        """The slices of each bucket's parameters in this rank's own shard buffer."""
        return [shard.pieces(decays, in_norm, values)
                for shard, values in zip(self.shards, self.values)]

    def after_optimizer_step(self):
        """Nothing to gather: the next step's UNSHARD actions gather the updated shards."""

    def stage_weights(self, chunks, policy):
        if self.weights is None:
            self.weights = StageWeights(self.shards, self.values, chunks, policy, self.wait)
        return self.weights

    def close(self):
        if self.weights is not None:
            self.weights.close()

    def held_weights(self):
        return list(self.values)
