"""How a bucket's gradients become their DP mean: exactly in fp32, or on bf16 copies.

A reducer's ``launch(bucket, shard)`` starts the bucket's mean over the DP group, asynchronously
(during the backward, for the overlapped buckets), leaving its works and completion steps on
the bucket; ``finish(buckets, wait)`` completes every bucket. Under ZeRO the result lands in
this rank's ``shard.grad``, else in ``bucket.grad``. Averaging pre-divides by ``d`` and sums
(see ``hybrid.dp.sync``). ``hybrid.dp.powersgd`` is the third reducer.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from hybrid.dp.buckets import Bucket
from hybrid.comm import Group
from hybrid.dp.zero import Shard


class ExactMean:
    """fp32 all-reduce, or under ZeRO a reduce-scatter into the shard."""

    def __init__(self, group: Group):
        self.group, self.d = group, group.size()

    def start_step(self, step: int) -> None:
        """Told the optimizer step about to be reduced (1-based); exact reducers ignore it."""

    def launch(self, bucket: Bucket, shard: Optional[Shard]) -> None:
        bucket.grad.mul_(1.0 / self.d)
        if shard is not None:
            shard.launch_reduce_scatter(self.group)
        else:
            bucket.works.append(self.group.all_reduce(bucket.grad, async_op=True))

    def finish(self, buckets: Sequence[Bucket], wait: Callable) -> None:
        for bucket in buckets:
            bucket.wait(wait)


class Bf16Mean(ExactMean):
    """The same collectives on a bf16 copy (half the bytes), accumulated back into the fp32
    gradients: each element's mean is rounded to bf16 once per rank's contribution and sum."""

    def launch(self, bucket: Bucket, shard: Optional[Shard]) -> None:
        low = bucket.grad.mul(1.0 / self.d).to(torch.bfloat16)
        if shard is not None:
            out = torch.empty(shard.end - shard.start, dtype=torch.bfloat16, device=low.device)
            bucket.works.append(self.group.reduce_scatter_into(out, low, async_op=True))
            bucket.on_done.append(lambda: shard.grad.copy_(out))
        else:
            bucket.works.append(self.group.all_reduce(low, async_op=True))
            bucket.on_done.append(lambda: bucket.grad.copy_(low))
