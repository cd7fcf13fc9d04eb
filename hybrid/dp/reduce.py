"""The reductions at run time: how the replicas' gradients are combined. ``ExactMean`` is the
protocol every reduction runtime follows (the runtime of a spec in
``hybrid.planning.strategies``, built by ``GradSync`` as ``cls(buckets, options, wait)``):

- ``launch(bucket, shard)`` starts the bucket's mean over ``bucket.group`` (its placement's
  reduction group: dp x cp for dense weights, the expert-DP group for experts), asynchronously
  (during the backward, for the overlapped buckets), leaving its works and completion steps on
  the bucket; ``finish(buckets, wait)`` completes every bucket. Under ZeRO the result lands in
  this rank's ``shard.grad``, else in ``bucket.grad``. Averaging pre-divides by ``d`` and sums
  (see ``hybrid.dp.sync``). ``averages_each_step = False``: the step launches none.
- ``before_update(wait)`` says whether the optimizer applies this step's gradients;
  ``after_update(step, buckets, optimizer)`` follows the optimizer step.
- ``state_tensors()`` is what it keeps between steps (``memory_check.json`` counts it), and
  ``checkpoint_state`` / ``checkpoint_targets`` / ``load_checkpoint_state`` carry it through a
  checkpoint by name (``hybrid.dp.option_state``).

Here: exact fp32 and bf16 copies; ``hybrid.dp.powersgd`` and ``hybrid.dp.replicas`` hold the
others.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from hybrid.dp.buckets import Bucket
from hybrid.dp.zero import Shard


NameOf = Callable[[int, int], str]
"""``(bucket index, slot)`` -> the global name of that parameter."""


class ExactMean:
    """fp32 all-reduce, or under ZeRO a reduce-scatter into the shard."""

    averages_each_step = True

    def __init__(self, buckets: Sequence[Bucket], options=None,
                 wait: Optional[Callable] = None):
        self.buckets, self.options, self.wait = list(buckets), options, wait

    def start_step(self, step: int) -> None:
        """Told the optimizer step about to be reduced (1-based); exact reducers ignore it."""

    def before_update(self) -> bool:
        """Whether the optimizer applies this step's (reduced) gradients."""
        return True

    def after_update(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer step ``step`` (applied or not)."""

    def state_tensors(self) -> list[torch.Tensor]:
        """What it keeps between steps besides gradients."""
        return []

    def checkpoint_state(self, name_of: NameOf) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of it, by key (parameter names tell stages apart)."""
        return {}

    def checkpoint_targets(self, name_of: NameOf) -> dict[str, torch.Tensor]:
        """Tensors for a checkpoint to load ``checkpoint_state`` into."""
        return {key: torch.zeros_like(t) for key, t in self.checkpoint_state(name_of).items()}

    def load_checkpoint_state(self, states: dict[str, torch.Tensor], name_of: NameOf) -> None:
        """Take ``checkpoint_targets`` filled by a checkpoint."""

    def launch(self, bucket: Bucket, shard: Optional[Shard]) -> None:
        group = bucket.group
        bucket.grad.mul_(1.0 / group.size())
        if shard is not None:
            shard.launch_reduce_scatter(group)
        else:
            bucket.works.append(group.all_reduce(bucket.grad, async_op=True))

    def finish(self, buckets: Sequence[Bucket], wait: Callable) -> None:
        for bucket in buckets:
            bucket.wait(wait)


class Bf16Mean(ExactMean):
    """The same collectives on a bf16 copy (half the bytes), accumulated back into the fp32
    gradients: each element's mean is rounded to bf16 once per rank's contribution and sum."""

    def launch(self, bucket: Bucket, shard: Optional[Shard]) -> None:
        group = bucket.group
        low = bucket.grad.mul(1.0 / group.size()).to(torch.bfloat16)
        if shard is not None:
            out = torch.empty(shard.end - shard.start, dtype=torch.bfloat16, device=low.device)
            bucket.works.append(group.reduce_scatter_into(out, low, async_op=True))
            bucket.on_done.append(lambda: shard.grad.copy_(out))
        else:
            bucket.works.append(group.all_reduce(low, async_op=True))
            bucket.on_done.append(lambda: bucket.grad.copy_(low))
