"""Data parallelism that does not average every step's gradients at once (two reduction
runtimes, see ``hybrid.dp.reduce``).

``LocalSGD`` (``parallel.dp_sync_every=H``): each DP replica steps on its own gradients; every
H-th step the replicas' parameters, and with ``dp_sync_moments`` AdamW's two moments, are
averaged over DP (``average_replicas``), one flat all-reduce per bucket and kind.

``DelayedMean`` (``parallel.dp_delay=1``): at the end of step ``t`` the gradients' DP mean is
started asynchronously and the optimizer applies step ``t-1``'s mean, so the all-reduce runs
while step ``t+1`` computes. Step 1 has nothing to apply: it takes no optimizer step. The mean
in flight is one fp32 copy of the gradients; it is part of a checkpoint.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from hybrid.dp.buckets import Bucket
from hybrid.dp.reduce import ExactMean, NameOf


def average_replicas(buckets: Sequence[Bucket], optimizer: torch.optim.Optimizer,
                     wait: Callable, *, moments: bool) -> None:
    """Replace every parameter (and its moments) by its mean over its bucket's group (dp x cp
    for dense weights, the expert-DP group for experts)."""
    pending = []
    for bucket in buckets:
        group = bucket.group
        if group.size() == 1:
            continue
        kinds = [[p.detach() for p in bucket.params]]
        if moments:
            kinds += [[optimizer.state[p][key] for p in bucket.params]
                      for key in ("exp_avg", "exp_avg_sq")]
        for tensors in kinds:
            flat = torch.cat([t.reshape(-1) for t in tensors])
            pending.append((group.all_reduce(flat, async_op=True), flat, tensors, group.size()))
    for work, flat, tensors, d in pending:
        wait(work)
        flat.mul_(1.0 / d)
        start = 0
        for tensor in tensors:
            tensor.copy_(flat[start:start + tensor.numel()].view_as(tensor))
            start += tensor.numel()


class LocalSGD(ExactMean):
    """Replicas step alone; their parameters (and moments) averaged every H steps."""

    averages_each_step = False

    def after_update(self, step, optimizer):
        if step % self.options.sync_every == 0:
            average_replicas(self.buckets, optimizer, self.wait, moments=self.options.sync_moments)


class DelayedMean(ExactMean):
    """The gradients' DP mean applied one step late (see module doc)."""

    averages_each_step = False

    def __init__(self, buckets: Sequence[Bucket], options=None, wait=None):
        super().__init__(buckets, options, wait)
        self.in_flight: Optional[list[torch.Tensor]] = None
        """Per bucket, the previous step's mean (being reduced until ``works`` are done)."""
        self.works: list = []

    def before_update(self) -> bool:
        return self.swap(self.wait)

    def swap(self, wait: Callable) -> bool:
        """Put the previous step's mean into the gradient buffers and start this step's;
        returns whether there was a previous step's mean to apply."""
        for work in self.works:
            wait(work)
        started = [b.grad.mul(1.0 / b.group.size()) for b in self.buckets]
        ready = self.in_flight is not None
        for bucket, previous in zip(self.buckets, self.in_flight or []):
            bucket.grad.copy_(previous)
        self.works = [b.group.all_reduce(t, async_op=True)
                      for b, t in zip(self.buckets, started)]
        self.in_flight = started
        return ready

    def state_tensors(self) -> list[torch.Tensor]:
        """The mean in flight (``memory_check.json`` counts it): allocated after step 1."""
        return list(self.in_flight or [])

    def settled(self, wait: Callable) -> list[torch.Tensor]:
        """The mean in flight, once its all-reduce is done (to save it)."""
        for work in self.works:
            wait(work)
        self.works = []
        return self.state_tensors()

    def load(self, means: list[torch.Tensor]) -> None:
        self.works = []
        self.in_flight = [m.clone() for m in means]

    def checkpoint_state(self, name_of: NameOf) -> dict[str, torch.Tensor]:
        return {f"delayed.{i}": t for i, t in enumerate(self.settled(self.wait))}

    def checkpoint_targets(self, name_of: NameOf) -> dict[str, torch.Tensor]:
        return {f"delayed.{i}": torch.zeros_like(b.grad) for i, b in enumerate(self.buckets)}

    def load_checkpoint_state(self, states, name_of) -> None:
        self.load([states[f"delayed.{i}"] for i in range(len(self.buckets))])
