"""ZeRO-1 (and the shards ZeRO-2 shares): optimizer state sharded over the DP group.

Every bucket (see ``dp.buckets``) is padded to a multiple of the DP size ``d`` and cut into
``d`` equal, contiguous shards; DP rank ``r`` owns shard ``r`` of every bucket. Per step:

1. the bucket's gradient buffer is reduce-scattered over DP (mean, pre-divided by ``d``) into
   this rank's shard gradient: a separate buffer of ``numel/d`` (gloo does not promise that an
   output overlapping its input is safe);
2. the optimizer steps only the ``Piece``s of its shard: for each parameter, the slice of it
   that lies in the shard, a view of the bucket's flat parameter buffer, in the weight-decay
   group of that parameter; AdamW's ``exp_avg``/``exp_avg_sq`` exist for those elements only;
3. each bucket's flat parameter buffer is all-gathered over DP from the shards; the model's
   parameters are views of it, so they are updated in place.

Padding elements belong to no parameter, so they have no optimizer state: per rank the
per-element state is exactly ``1/d`` of the unsharded state when every bucket's size is a
multiple of ``d``, and otherwise differs by at most the padding (the shards still add up to
exactly the unsharded state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from hybrid.dp.buckets import Bucket, Piece
from hybrid.comm import Group



@dataclass(eq=False)
class Shard:
    """This rank's ``[start, end)`` of a bucket's flat buffers, and its reduced gradient."""

    bucket: Bucket
    start: int
    end: int
    grad: torch.Tensor

    @classmethod
    def of(cls, bucket: Bucket, dp_rank: int, dp_size: int) -> "Shard":
        assert bucket.numel % dp_size == 0, "a ZeRO bucket must be padded to the DP size"
        assert bucket.data is not None, "a ZeRO bucket needs flat parameters"
        size = bucket.numel // dp_size
        start = dp_rank * size
        # With one DP rank there is nothing to scatter: the shard is the whole buffer (unless
        # ZeRO-2 keeps no full buffer).
        if dp_size == 1 and bucket.grad.numel():
            grad = bucket.grad
        else:
            grad = torch.zeros(size, dtype=bucket.data.dtype, device=bucket.data.device)
        return cls(bucket=bucket, start=start, end=start + size, grad=grad)

    def pieces(self, decays: Callable[[torch.Tensor], bool],
               counts_in_norm: Callable[[torch.Tensor], bool],
               values: Optional[torch.Tensor] = None) -> list[Piece]:
        """The slices of the bucket's parameters inside this shard, as optimizer pieces: views
        of ``values`` (the shard's own buffer under ZeRO-3), else of the bucket's flat
        parameters."""
        if values is None:
            values = self.bucket.data[self.start:self.end]
        found = []
        for slot, param in enumerate(self.bucket.params):
            begin, finish = self.bucket.span(slot)
            lo, hi = max(begin, self.start), min(finish, self.end)
            if lo >= hi:
                continue
            tensor = values[lo - self.start:hi - self.start]
            tensor.grad = self.grad[lo - self.start:hi - self.start]
            found.append(Piece(tensor=tensor, grad=tensor.grad, param=param, offset=lo - begin,
                               decays=decays(param), counts_in_norm=counts_in_norm(param)))
        return found

    def launch_reduce_scatter(self, group: Group) -> None:
        """Start the (sum) reduce-scatter of the bucket's gradients into ``self.grad``."""
        if group.size() == 1:  # an expert bucket held by one rank: nothing to scatter
            if self.grad.data_ptr() != self.bucket.grad.data_ptr():
                self.grad.copy_(self.bucket.grad[self.start:self.end])
            return
        work = group.reduce_scatter_into(self.grad, self.bucket.grad, async_op=True)
        self.bucket.works.append(work)


def all_gather_params(shards: Sequence[Shard],
                      wait: Callable[[dist.Work], None] = dist.Work.wait) -> None:
    """Rebuild every bucket's flat parameters from the updated shards of its sharding group
    (in place).

    Each rank's input is exactly its own slot of the output, as in Megatron's distributed
    optimizer: the collective's copy of the input into that slot is then a no-op.
    """
    works = []
    for s in shards:
        mine = s.bucket.shard_group
        if mine.size() > 1:
            works.append(mine.all_gather_into(s.bucket.data, s.bucket.data[s.start:s.end],
                                              async_op=True))
    for work in works:
        wait(work)
