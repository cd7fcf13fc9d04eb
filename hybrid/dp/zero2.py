"""ZeRO-2: between steps a rank keeps only its shard of the gradients.

As DeepSpeed's stage 2 under gradient accumulation: a bucket's gradients are not accumulated
over the step's micro-batches in a full buffer. Each time every parameter of a bucket has
delivered its gradient (once per micro-batch), the bucket's gradients are copied into a flat
staging buffer, autograd's ``.grad`` is dropped, and the staging buffer is reduce-scattered
over DP and added into this rank's shard gradient. At most ``MAX_IN_FLIGHT`` staging buffers
wait for their reduce-scatter at a time. The buckets kept out of the overlap (partial sums over
TP or the embedding group) are staged for the whole step, summed over their group, then
reduce-scattered once. The price: the overlapped buckets' reduce-scatter runs once per
micro-batch instead of once per step. Optimizer shards and the parameter all-gather are
ZeRO-1's (``hybrid.dp.zero``).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

import torch

from hybrid.dp.buckets import GRAD_DTYPE, Bucket
from hybrid.dp.zero import Shard

MAX_IN_FLIGHT = 2


class StagedShards:
    """Per-micro-batch staging and reduce-scatter of every bucket into its shard."""

    def __init__(self, shards: Sequence[Shard], wait: Callable):
        self.shards, self.wait = list(shards), wait
        self.staging: dict[int, torch.Tensor] = {}
        self.arrived: dict[int, set] = {s.bucket.index: set() for s in self.shards}
        self.pending: deque = deque()
        self.extra_rounds = 0
        """Micro-batches other replicas run beyond this one's this step (unequal DP shares):
        their reduce-scatters are matched with zeros, spread among this replica's own rounds
        (``_pad_due``)."""
        self.own_rounds = 1
        """This replica's micro-batches this step."""
        self.padded = 0
        self.per_round = sum(not s.bucket.late for s in self.shards)
        """Buckets reduce-scattered per micro-batch during the backward."""
        self.launched: list[int] = []
        """Buckets reduce-scattered during this step's backward, in order."""

    def accumulated(self, bucket: Bucket, slot: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: move ``param``'s gradient into the bucket's staging."""
        staging = self.staging.get(bucket.index)
        if staging is None:
            staging = self.staging[bucket.index] = torch.zeros(
                bucket.numel, dtype=GRAD_DTYPE, device=param.device)
        begin, end = bucket.span(slot)
        staging[begin:end].add_(param.grad.reshape(-1))
        param.grad = None
        arrived = self.arrived[bucket.index]
        arrived.add(slot)
        if not bucket.late and len(arrived) == len(bucket.params):
            self.launched.append(bucket.index)
            self._launch(self.shards[bucket.index])
            if len(self.launched) % self.per_round == 0:
                self._pad_due(len(self.launched) // self.per_round)

    def _pad_due(self, rounds_done: int) -> None:
        """After this replica's ``rounds_done``-th micro-batch, the rounds of zeros due by
        then: spread in proportion, so that its rounds keep pace with a replica running more.
        Padded at the end instead, a faster replica's reduce-scatters would wait for this
        one's micro-batches and then run alone: the step as long as with even shares."""
        total = self.own_rounds + self.extra_rounds
        due = rounds_done * total // self.own_rounds - rounds_done - self.padded
        self._pad(min(due, self.extra_rounds - self.padded))

    def _pad(self, rounds: int) -> None:
        """``rounds`` rounds of zeros in the order of one micro-batch's buckets."""
        for _ in range(rounds):
            for index in self.launched[:self.per_round]:
                shard = self.shards[index]
                self.staging[index] = torch.zeros(shard.bucket.numel, dtype=GRAD_DTYPE,
                                                  device=shard.grad.device)
                self._launch(shard)
        self.padded += max(0, rounds)

    def _launch(self, shard: Shard) -> None:
        index = shard.bucket.index
        staging = self.staging.pop(index)
        self.arrived[index] = set()
        group = shard.bucket.shard_group
        staging.mul_(1.0 / group.size())
        if group.size() == 1:
            shard.grad.add_(staging)
            return
        out = torch.empty_like(shard.grad)
        work = group.reduce_scatter_into(out, staging, async_op=True)
        self.pending.append((work, out, shard))
        while len(self.pending) > MAX_IN_FLIGHT:
            self._settle_oldest()

    def _settle_oldest(self) -> None:
        work, out, shard = self.pending.popleft()
        self.wait(work)
        shard.grad.add_(out)

    def flush(self) -> None:
        """End of the step's backward: reduce what is still staged (the late buckets, after
        their own group's sum; any bucket a parameter sent no gradient to) and settle all.
        Before them, the rounds of zeros not yet padded, so every replica issues the same
        reduce-scatters in the same order."""
        self._pad(self.extra_rounds - self.padded)
        self.extra_rounds, self.launched, self.padded = 0, [], 0
        for shard in self.shards:
            bucket = shard.bucket
            if bucket.index not in self.staging:
                continue
            if bucket.late and bucket.reduce_first.size() > 1:
                bucket.reduce_first.all_reduce(self.staging[bucket.index])
            self._launch(shard)
        while self.pending:
            self._settle_oldest()
