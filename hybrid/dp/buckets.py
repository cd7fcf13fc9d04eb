"""Gradient buckets: flat fp32 buffers that the parameters' ``.grad`` are views into.

As torch DDP with ``gradient_as_bucket_view=True``: each bucket owns one contiguous fp32 buffer,
and every parameter of the bucket gets ``param.grad = buffer[offset:offset + numel].view(shape)``
once, at construction. Autograd then accumulates micro-batch gradients in place into the buffer
(``AccumulateGrad`` adds into an existing ``.grad``), so a bucket's collective reads the buffer
directly with no copy in or out. ``.grad`` must therefore never be replaced or set to ``None``
(no ``optimizer.zero_grad()`` / ``model.zero_grad()``): ``GradSync.zero_grad`` zeroes buffers.

Buckets are filled in backward order (the reverse of registration order), so the first bucket
holds the gradients that autograd finishes first. A bucket's buffer is padded to a multiple of
``pad_to`` (the DP size under ZeRO-1, so that it splits into equal shards); the padding is zero
and belongs to no parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from hybrid.comm import Group
from hybrid.optim import spec_of

GRAD_DTYPE = torch.float32  # reduction happens in fp32 whatever the compute precision


@dataclass(eq=False)
class Piece:
    """A tensor the optimizer steps and its gradient: a model parameter, or under ZeRO-1 the
    slice of one that lies in this rank's shard, elements ``[offset, offset + numel)`` of the
    flattened ``param`` (what a checkpoint needs to place its optimizer state).
    ``counts_in_norm``: see ``dp.clip``."""

    tensor: torch.Tensor
    grad: torch.Tensor
    param: torch.nn.Parameter
    offset: int
    decays: bool
    counts_in_norm: bool


def plan_buckets(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of ``params`` (already in backward order); a bucket is closed as soon
    as it holds at least ``bucket_bytes`` of fp32 gradients, so only the last may be smaller."""
    assert bucket_bytes > 0
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for param in params:
        current.append(param)
        size += param.numel() * GRAD_DTYPE.itemsize
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def padded(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


@dataclass(eq=False)
class Bucket:
    """One flat gradient buffer and the parameters that are views into it.

    ``reduce_first`` is set for the buckets kept out of the overlapped DP sync: their gradients
    are partial sums over another group (sequence-parallel norms over TP, a tied embedding over
    the embedding group) and are summed there before the DP reduction.
    """

    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    grad: torch.Tensor
    group: Group
    """The ranks that average this bucket's gradients: its parameters' ``placement.reduce_role``
    (one placement per bucket). Every DP strategy reduces, averages or delays over it."""
    shard_group: Group
    """The ranks a ZeRO stage shards it over (and gathers its weights over): its placement's
    ``shard_role``. No strategy holds a group of its own: the bucket says where it goes."""
    reduce_first: Optional[Group] = None
    data: Optional[torch.Tensor] = None
    # per-step state, reset by start_step
    accumulations: list[int] = field(default_factory=list)
    final_params: int = 0
    works: list = field(default_factory=list)
    on_done: list = field(default_factory=list)
    """Callables run once the bucket's collectives are done (e.g. copy a bf16 result back)."""

    @classmethod
    def allocate(cls, index: int, params: list[torch.nn.Parameter], *, pad_to: int,
                 group: Group, shard_group: Group, reduce_first: Optional[Group] = None,
                 grad_buffer: bool = True) -> "Bucket":
        """``grad_buffer=False`` (ZeRO-2): no persistent buffer, ``.grad`` stays autograd's
        and ``hybrid.dp.zero2`` stages it per micro-batch."""
        offsets, total = [], 0
        for param in params:
            offsets.append(total)
            total += param.numel()
        numel = padded(total, pad_to)
        device = params[0].device
        grad = torch.zeros(numel if grad_buffer else 0, dtype=GRAD_DTYPE, device=device)
        bucket = cls(index=index, params=params, offsets=offsets, numel=numel, grad=grad,
                     reduce_first=reduce_first, group=group, shard_group=shard_group)
        if grad_buffer:
            for slot, param in enumerate(params):
                param.grad = bucket.grad_view(slot)
        return bucket

    @property
    def late(self) -> bool:
        return self.reduce_first is not None

    def span(self, slot: int) -> tuple[int, int]:
        start = self.offsets[slot]
        return start, start + self.params[slot].numel()

    def grad_view(self, slot: int) -> torch.Tensor:
        start, end = self.span(slot)
        return self.grad[start:end].view_as(self.params[slot])

    def flatten_params(self) -> None:
        """Move the parameters' values into one flat fp32 buffer and make them views of it
        (ZeRO-1: the all-gather of updated shards then updates the model in place)."""
        self.data = torch.zeros(self.numel, dtype=GRAD_DTYPE, device=self.params[0].device)
        for slot, param in enumerate(self.params):
            start, end = self.span(slot)
            self.data[start:end].copy_(param.detach().reshape(-1))
            param.data = self.data[start:end].view_as(param)

    def check_grad_is_view(self, slot: int) -> None:
        param = self.params[slot]
        start, _ = self.span(slot)
        if param.grad is None or param.grad.data_ptr() != self.grad[start:].data_ptr():
            raise RuntimeError(
                "a parameter's .grad was replaced (zero_grad(set_to_none=True)?); hybrid keeps "
                ".grad as a view of its DP bucket: zero gradients with GradSync.zero_grad()")

    def reset_step(self) -> None:
        assert not self.works, "a bucket's collective was never waited for"
        self.accumulations = [0] * len(self.params)
        self.final_params = 0

    def wait(self, wait: Callable[[Any], None]) -> None:
        """``wait(work)`` for each collective started on the bucket, then its ``on_done``."""
        for work in self.works:
            wait(work)
        self.works.clear()
        for done in self.on_done:
            done()
        self.on_done.clear()


def reduce_first_axis(param: torch.Tensor, groups) -> Union[str, None]:
    """The role whose partial gradients must be summed before the DP mean, if any:
    ``"tensor"`` for sequence-parallel parameters (each TP rank saw its slice of the
    sequence), ``"embedding"`` for a tied embedding split over the first and last stage."""
    spec = spec_of(param)
    if spec.sequence_partial and groups.layout.tp > 1:
        return "tensor"
    if spec.tied and groups.layout.pp > 1:
        return "embedding"
    return None


def by_placement(params: Sequence[torch.Tensor]) -> dict:
    """``params`` grouped by their spec's ``Placement``, in first-seen order (each group keeps
    the order of ``params``): a bucket holds one placement, so one group reduces it."""
    groups: dict = {}
    for param in params:
        groups.setdefault(spec_of(param).placement, []).append(param)
    return groups


def build_buckets(params: list[torch.nn.Parameter], groups, *, bucket_bytes: int, pads: bool,
                  grad_buffer: bool, flatten: bool) -> tuple[list[Bucket], int]:
    """``GradSync``'s buckets over ``params`` (registration order) and how many of them are
    overlapped with the backward. Buckets fill in backward order, one placement per bucket
    (a dense model has one placement: the buckets are as before placements existed);
    parameters whose gradients are partial sums over another group (``reduce_first_axis``) go
    into late buckets of their own at the end (simplest correct way: summed over their group
    in ``reduce_gradients``, then DP-reduced like any other). The sharding strategy
    (``hybrid.dp.sharding``) says how: ZeRO pads each to its sharding group's size (``pads``)
    and
    flattens the parameters (``flatten``); ZeRO-2 keeps no gradient buffer
    (``grad_buffer=False``: ``hybrid.dp.zero2`` stages it)."""
    late: dict[str, list] = {"tensor": [], "embedding": []}
    overlapped = []
    for param in reversed(params):
        axis = reduce_first_axis(param, groups)
        (late[axis] if axis else overlapped).append(param)
    buffer = grad_buffer
    buckets: list[Bucket] = []
    def placed(placement) -> dict:
        shard = groups.role(placement.shard_role)
        return dict(pad_to=shard.size() if pads else 1, shard_group=shard,
                    group=groups.role(placement.reduce_role), grad_buffer=buffer)

    for placement, ps in by_placement(overlapped).items():
        for chunk in plan_buckets(ps, bucket_bytes):
            buckets.append(Bucket.allocate(len(buckets), chunk, **placed(placement)))
    num_overlapped = len(buckets)
    for axis, ps in late.items():
        for placement, same in by_placement(ps).items():
            buckets.append(Bucket.allocate(len(buckets), same, reduce_first=groups.role(axis),
                                           **placed(placement)))
    if flatten:
        for bucket in buckets:
            bucket.flatten_params()
    return buckets, num_overlapped
