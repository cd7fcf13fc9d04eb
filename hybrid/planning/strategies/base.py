"""What a DP strategy spec is (pure; no torch): the config's DP settings (``DpOptions``), what
one rank's traffic depends on (``RankTraffic``, ``DpTime``), the ring volumes, and the two kinds
of spec, ``ShardingSpec`` and ``ReductionSpec``, with their defaults. The registry that holds
the specs is ``registry``."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hybrid.planning.cost.collectives import BUCKET_BYTES
from hybrid.planning.cost.devices import Device, Link
from hybrid.planning.cost.state_bytes import (FP32, StateBytes, bucket_members, bucket_sizes,
                                              late_axis)

BF16 = 2
SCALAR = 8  # one float64
Shape = tuple[int, ...]


@dataclass(frozen=True)
class DpOptions:
    """The config's DP settings (``ParallelConfig`` fields) that choose the strategies."""

    zero: int = 0
    compress: str = "none"
    powersgd_rank: int = 2
    powersgd_warmup: int = 10
    sync_every: int = 1
    sync_moments: bool = False
    delay: int = 0
    reshard: str = "after_forward"
    """ZeRO-3's release policy (``hybrid.planning.schedules.gathers``)."""

    @classmethod
    def of(cls, parallel) -> "DpOptions":
        """From ``parallel.dp_strategy`` (``hybrid.planning.dp_config``)."""
        dp = parallel.dp_strategy
        return cls(zero=dp.zero.stage, compress=dp.compress, powersgd_rank=dp.powersgd.rank,
                   powersgd_warmup=dp.powersgd.warmup, sync_every=dp.local_sgd.every,
                   sync_moments=dp.local_sgd.moments, delay=dp.delay, reshard=dp.zero.reshard)

    def uncompressed(self) -> "DpOptions":
        """The exact options with the same ZeRO stage (what the bytes are compared with)."""
        return DpOptions(zero=self.zero, reshard=self.reshard)

    def compressing(self, step: int) -> bool:
        """Whether step ``step`` (1-based) runs PowerSGD (after its exact warm-up steps)."""
        return self.compress == "powersgd" and step > self.powersgd_warmup


def all_reduce_bytes(payload: float, d: int) -> float:
    return 2.0 * (d - 1) / d * payload if d > 1 else 0.0


def scatter_bytes(payload: float, d: int) -> float:
    """Reduce-scatter or all-gather of a ``payload``-byte buffer."""
    return (d - 1) / d * payload if d > 1 else 0.0


@dataclass
class RankTraffic:
    """What one rank's DP traffic depends on: the local shapes of the parameters it trains (in
    registration order, each with the late bucket it goes to, or ""), the DP size, the
    micro-batches per step and the bucket size (``parallel.bucket_mb``). ``shapes_of`` makes
    the shapes when first asked (a layout search prices thousands of ranks whose exact
    reductions need only their parameter count)."""

    shapes_of: Callable[[], list[tuple[Shape, str]]]
    dp: int
    microbatches: int
    bucket_mb: float
    gathers: Optional[list[int]] = None
    """ZeRO-3: how often each bucket is gathered in a step (the schedule's UNSHARDs)."""

    def mean_gathers(self) -> float:
        """Gathers of the rank's weights a step (1 when not given)."""
        if not self.gathers:
            return 1.0
        return sum(self.gathers) / len(self.gathers)

    @functools.cached_property
    def shapes(self) -> list[tuple[Shape, str]]:
        return list(self.shapes_of())

    def buckets(self) -> list[list[Shape]]:
        """Shapes per bucket, in ``bucket_sizes``' grouping (backward order, late last)."""
        members = bucket_members([(math.prod(s), tag) for s, tag in self.shapes],
                                 self.bucket_mb)
        return [[self.shapes[i][0] for i in bucket] for bucket in members]

    def numels(self) -> list[int]:
        return [sum(math.prod(s) for s in bucket) for bucket in self.buckets()]

    def overlapped(self) -> int:
        """How many buckets start during the backward (the late ones wait for their sum)."""
        return len(bucket_sizes([(math.prod(s), tag) for s, tag in self.shapes
                                 if not late_axis(tag)], self.bucket_mb))


@dataclass(frozen=True)
class DpTime:
    """What the time of one rank's DP traffic depends on besides its ``RankTraffic``."""

    device: Device
    link: Link
    params: int
    """The rank's parameter count."""
    backward: float
    """One micro-batch's backward on this rank: what the last bucket's reduction can hide in."""
    makespan: float
    """The pipeline's time: what a reduction a step late can hide in."""
    matmul_width: float
    """A weight's width per TP rank (the rate of a lossy option's own arithmetic)."""
    last_params: float = 0.0
    """Weights whose gradient the backward makes last: on the first stage the word
    embedding, whose gradient is complete only after the input's lookup is differentiated,
    the backward's very last step; a tensor larger than a bucket is a bucket of its own."""
    bucket_bytes: float = BUCKET_BYTES
    """A bucket's size (``parallel.bucket_mb``): one collective, one ring latency, each."""

    def buckets(self, grad_bytes: float) -> int:
        if self.device.dp_one_collective:
            return 1
        return max(1, math.ceil(grad_bytes / self.bucket_bytes))

    def last_bucket_bytes(self, width: int) -> float:
        """The bucket that is ready only when the backward ends, so that no compute is left
        to hide its reduction behind: the last weights' gradients, or a bucket's worth of
        the first layer's, at most all of them."""
        return min(width * self.params, max(width * self.last_params, self.bucket_bytes))


class ShardingSpec:
    """How the DP state is sharded: ``parallel.zero = stage`` (subclasses: ``zero.py``)."""

    stage: int = 0
    name: str = ""
    runtime: Any = ""
    """The runtime class (``hybrid.dp``), or its dotted ``module:Class`` name."""
    shards_optimizer = False
    shards_gradients = False
    gathers_params = False
    """ZeRO-3: weights gathered per use (the schedule gets UNSHARD/RESHARD actions)."""
    searched = False
    """Tried by the layout search."""
    searched_if_less_fails = False
    """Tried only on layouts that fit at no lower stage (it is never faster than those)."""
    doc = ""

    def state_bytes(self, tensors: list[tuple[int, str]], *, dp: int, dp_rank: int,
                    bucket_mb: float) -> StateBytes:
        """Bytes of weights, gradients and AdamW state on one rank, as the runtime allocates
        them (``tensors``: each parameter's numel and late bucket)."""
        raise NotImplementedError

    def closed_form_state(self, params: int, dp: int) -> StateBytes:
        """``state_bytes`` without bucket padding and step counts (the layout search)."""
        raise NotImplementedError

    def gradient_bytes(self, traffic: RankTraffic, width: int) -> float:
        """Bytes one rank sends per step to average gradients of ``width`` bytes an element
        (and, sharded, to gather the updated parameters)."""
        raise NotImplementedError

    def memory_floor(self, lower, dp: int) -> int:
        """A floor under a rank's bytes at this stage, from its estimate at the stage below
        (``searched_if_less_fails``: the search skips layouts whose floor does not fit)."""
        return 0

    def time(self, traffic: RankTraffic, timing: DpTime, width: int) -> tuple[float, float]:
        """(the DP traffic's time per step, the part the backward does not hide)."""
        raise NotImplementedError

    def choices(self) -> list[tuple[str, dict]]:
        """(label, ``parallel.*`` settings) of this stage in ``hybrid-plan``'s DP table."""
        return []


class ReductionSpec:
    """How the replicas' gradients are combined (subclasses: ``exact.py``, ``bf16.py``, ...).
    The defaults are an exact-shaped reduction of ``grad_width``-byte elements: the sharding's
    collectives at that width."""

    name: str = ""
    runtime: Any = ""
    exact = False
    """The 1-process model's gradients, to rounding (else: lossy, the losses part)."""
    grad_width: Optional[int] = FP32
    shardings: tuple[int, ...] = (0,)
    """The ZeRO stages it runs with."""
    checkpoint_fields: tuple[str, ...] = ()
    """``parallel.*`` fields its checkpointed state depends on (besides the layout): a resume
    with other values starts that state afresh."""
    state_by_parameter = True
    """Its state between steps is filed by parameter name, so it can follow a layer to
    another pipeline stage (``parallel.pp_balance=dynamic``); False: it is a bucket's."""
    doc = ""

    def setting(self, options: DpOptions) -> Optional[str]:
        """The setting that selects it (``"dp_compress=bf16"``), or None when not selected."""
        return None

    def field_problem(self, options: DpOptions) -> Optional[str]:
        """Its own settings out of range, whether or not it is selected."""
        return None

    def problem(self, options: DpOptions, dp: int) -> Optional[str]:
        """What else it needs, once selected (beyond its shardings and one replica)."""
        return None

    def run_problem(self, options: DpOptions, *, steps: int,
                    checkpoint_every: int) -> Optional[str]:
        """What it needs of the run's length and checkpoints, once selected."""
        return None

    def step_bytes(self, traffic: RankTraffic, options: DpOptions, step: int,
                   sharding: ShardingSpec) -> float:
        return sharding.gradient_bytes(traffic, self.grad_width)

    def time(self, traffic: RankTraffic, timing: DpTime, options: DpOptions,
             sharding: ShardingSpec) -> tuple[float, float]:
        return sharding.time(traffic, timing, self.grad_width)

    def state_bytes(self, traffic: RankTraffic, options: DpOptions) -> int:
        """What it keeps between steps besides weights, gradients and AdamW."""
        return 0

    def cycle(self, options: DpOptions) -> int:
        """Steps after which its traffic repeats (its last step sends the most)."""
        return 1

    def choices(self) -> list[tuple[str, dict]]:
        """(label, ``parallel.*`` settings) of the variants ``hybrid-plan`` prices."""
        return []
