"""What each data-parallel option sends and keeps, per rank and step (pure: no torch).

The options (``parallel.*``, see ``hybrid.planning.config.ParallelConfig``) and what they do to the DP
gradient mean of a step:

- ``zero=0|1|2``: all-reduce the buckets; reduce-scatter them once per step and all-gather the
  updated parameters (ZeRO-1); reduce-scatter every micro-batch's gradients as they are made,
  keeping only the shard (ZeRO-2, as DeepSpeed's stage 2 does under gradient accumulation).
- ``dp_compress=bf16``: the same collectives on bf16 copies of the gradients.
- ``dp_compress=powersgd``: per bucket, one all-reduce of the tensors left uncompressed and
  one each of the low-rank factors ``P`` (``n x r``) and ``Q`` (``m x r``) of every matrix
  that compression shrinks at least ``POWERSGD_MIN_COMPRESSION`` times (torch's rule, with a
  tensor viewed as ``shape[0] x rest``); exact for the first ``powersgd_warmup`` steps.
- ``dp_sync_every=H``: no gradient reduction; every H-th step one all-reduce of the parameters
  (and of AdamW's two moments with ``dp_sync_moments``).
- ``dp_delay=1``: step ``t`` all-reduces its gradients while step ``t+1`` computes: the same
  bytes as ``zero=0``, one step late.

Besides the gradients, every step all-reduces its loss (one float64) over DP, and under ZeRO
the squared gradient norm (one float64). ``hybrid.comm.CommCounter`` counts the same bytes
(``wire_bytes``: ring all-reduce ``2(d-1)/d·n``, reduce-scatter and all-gather ``(d-1)/d·n``);
the end-to-end tests assert they agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybrid.planning.cost.state_bytes import FP32, bucket_sizes

BF16 = 2
SCALAR = 8  # one float64
POWERSGD_MIN_COMPRESSION = 2
COMPRESSIONS = ("none", "bf16", "powersgd")

Shape = tuple[int, ...]


@dataclass(frozen=True)
class DpOptions:
    """The DP options of a config that change what is sent (``ParallelConfig`` fields)."""

    zero: int = 0
    compress: str = "none"
    powersgd_rank: int = 2
    powersgd_warmup: int = 10
    sync_every: int = 1
    sync_moments: bool = False
    delay: int = 0

    @classmethod
    def of(cls, parallel) -> "DpOptions":
        return cls(zero=parallel.zero, compress=parallel.dp_compress,
                   powersgd_rank=parallel.powersgd_rank,
                   powersgd_warmup=parallel.powersgd_warmup,
                   sync_every=parallel.dp_sync_every, sync_moments=parallel.dp_sync_moments,
                   delay=parallel.dp_delay)

    @property
    def exact(self) -> bool:
        return self.compress == "none" and self.sync_every == 1 and self.delay == 0

    def uncompressed(self) -> "DpOptions":
        """The exact options with the same ZeRO stage (what the bytes are compared with)."""
        return DpOptions(zero=self.zero)

    def compressing(self, step: int) -> bool:
        """Whether step ``step`` (1-based) runs PowerSGD (after its exact warm-up steps)."""
        return self.compress == "powersgd" and step > self.powersgd_warmup


def as_matrix(shape: Shape) -> tuple[int, int]:
    """How PowerSGD views a gradient: ``shape[0]`` rows, everything else as columns."""
    return shape[0], math.prod(shape[1:])


def powersgd_compresses(shape: Shape, rank: int) -> bool:
    """Whether PowerSGD factors this gradient: a matrix whose two factors are at least
    ``POWERSGD_MIN_COMPRESSION`` times smaller than it."""
    if len(shape) < 2:
        return False
    n, m = as_matrix(shape)
    return (n + m) * rank * POWERSGD_MIN_COMPRESSION < n * m


def all_reduce_bytes(payload: float, d: int) -> float:
    return 2.0 * (d - 1) / d * payload if d > 1 else 0.0


def scatter_bytes(payload: float, d: int) -> float:
    """Reduce-scatter or all-gather of a ``payload``-byte buffer."""
    return (d - 1) / d * payload if d > 1 else 0.0


def bucket_shapes(shapes: list[tuple[Shape, str]], bucket_mb: float) -> list[list[Shape]]:
    """Shapes per bucket, in ``bucket_sizes``' grouping (backward order, late buckets last)."""
    numels = [(math.prod(shape), late) for shape, late in shapes]
    grouped = bucket_sizes(numels, bucket_mb)
    late = {"tp": [], "embedding": []}
    overlapped = []
    for shape, axis in reversed(shapes):
        (late[axis] if axis else overlapped).append(shape)
    ordered = iter(overlapped + late["tp"] + late["embedding"])
    return [[next(ordered) for _ in bucket] for bucket in grouped]


def step_bytes(shapes: list[tuple[Shape, str]], *, dp: int, options: DpOptions, step: int,
               microbatches: int, bucket_mb: float) -> float:
    """Bytes one rank sends over DP in optimizer step ``step`` (1-based), scalars included."""
    if dp == 1:
        return 0.0
    scalars = all_reduce_bytes(SCALAR, dp) * (2 if options.zero else 1)
    return scalars + gradient_bytes(shapes, dp=dp, options=options, step=step,
                                    microbatches=microbatches, bucket_mb=bucket_mb)


def gradient_bytes(shapes: list[tuple[Shape, str]], *, dp: int, options: DpOptions,
                   step: int, microbatches: int, bucket_mb: float) -> float:
    """Bytes one rank sends over DP for its gradients (or parameters) in step ``step``."""
    buckets = bucket_shapes(shapes, bucket_mb)
    numels = [sum(math.prod(s) for s in bucket) for bucket in buckets]
    if options.sync_every > 1:
        if step % options.sync_every:
            return 0.0
        copies = 3 if options.sync_moments else 1
        return sum(all_reduce_bytes(FP32 * n * copies, dp) for n in numels)
    if options.compressing(step):
        return sum(_powersgd_bucket_bytes(bucket, dp, options.powersgd_rank)
                   for bucket in buckets)
    width = BF16 if options.compress == "bf16" else FP32
    if not options.zero:
        return sum(all_reduce_bytes(width * n, dp) for n in numels)
    padded = [-(-n // dp) * dp for n in numels]
    overlapped = len(bucket_sizes([(math.prod(s), late) for s, late in shapes if not late],
                                  bucket_mb))
    # ZeRO-2 reduce-scatters the overlapped buckets once per micro-batch, the late ones
    # (summed over another group first) once per step.
    scatters = sum(scatter_bytes(width * n, dp) *
                   (microbatches if options.zero == 2 and i < overlapped else 1)
                   for i, n in enumerate(padded))
    return scatters + sum(scatter_bytes(FP32 * n, dp) for n in padded)


def _powersgd_bucket_bytes(bucket: list[Shape], dp: int, rank: int) -> float:
    rest = sum(math.prod(s) for s in bucket if not powersgd_compresses(s, rank))
    factors = [as_matrix(s) for s in bucket if powersgd_compresses(s, rank)]
    total = all_reduce_bytes(FP32 * rest, dp) if rest else 0.0
    if factors:
        total += all_reduce_bytes(FP32 * rank * sum(n for n, _ in factors), dp)
        total += all_reduce_bytes(FP32 * rank * sum(m for _, m in factors), dp)
    return total


def dp_state_bytes(shapes: list[tuple[Shape, str]], *, dp: int, options: DpOptions) -> int:
    """Bytes an option keeps between steps besides weights, gradients and AdamW: PowerSGD's
    error feedback and warm-start ``Q`` per compressed matrix; ``dp_delay``'s gradients in
    flight (one fp32 copy)."""
    if dp == 1:
        return 0
    if options.compress == "powersgd":
        r = options.powersgd_rank
        return sum(FP32 * (math.prod(s) + as_matrix(s)[1] * r) for s, _ in shapes
                   if powersgd_compresses(s, r))
    if options.delay:
        return FP32 * sum(math.prod(s) for s, _ in shapes)
    return 0


def option_problem(options: DpOptions, dp: int) -> str | None:
    """The one-line problem with a combination of DP options, or None."""
    o = options
    if o.zero not in (0, 1, 2):
        return f"parallel.zero={o.zero} is unknown; choose one of 0, 1, 2"
    if o.compress not in COMPRESSIONS:
        return f"parallel.dp_compress={o.compress!r} is unknown; choose one of " \
               f"{', '.join(COMPRESSIONS)}"
    for name, value, low in (("powersgd_rank", o.powersgd_rank, 1),
                             ("powersgd_warmup", o.powersgd_warmup, 0),
                             ("dp_sync_every", o.sync_every, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return f"parallel.{name}={value!r} must be an integer >= {low}"
    if o.delay not in (0, 1):
        return f"parallel.dp_delay={o.delay!r} is unknown; choose 0 or 1"
    if o.sync_moments and o.sync_every == 1:
        return "parallel.dp_sync_moments=true does nothing with parallel.dp_sync_every=1 " \
               "(every step is exact): set dp_sync_every > 1 or drop it"
    lossy = [f"{name}={value}" for name, value, on in (
        ("dp_compress", o.compress, o.compress != "none"),
        ("dp_sync_every", o.sync_every, o.sync_every > 1), ("dp_delay", o.delay, o.delay))
        if on]
    if lossy and dp == 1:
        return f"parallel.{lossy[0]} changes how DP replicas combine, and parallel.dp=1 has " \
               f"one replica: set parallel.dp > 1 or drop it"
    if len(lossy) > 1:
        return f"parallel.{lossy[0]} and parallel.{lossy[1]} do not combine; choose one"
    if o.zero == 2 and lossy:
        return f"parallel.zero=2 runs with exact reduction only, not parallel.{lossy[0]}; " \
               f"use parallel.zero=1 (bf16) or parallel.zero=0"
    if o.zero == 1 and lossy and o.compress != "bf16":
        return f"parallel.{lossy[0]} needs unsharded optimizer state: set parallel.zero=0"
    return None
