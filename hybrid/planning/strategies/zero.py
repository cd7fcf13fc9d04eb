"""The sharding strategies, ``parallel.zero`` = 0, 1 or 2 (pure): what each keeps and sends.

- 0 (replicated): every DP rank keeps whole gradients and AdamW state; one all-reduce of the
  buckets per step, hidden behind the last micro-batch's backward as far as it goes.
- 1 (ZeRO-1, optimizer state sharded): each bucket is padded to a multiple of the DP size;
  its gradients are reduce-scattered once per step into this rank's shard, AdamW keeps moments
  for the shard's elements only, and the updated parameters are all-gathered after the step.
- 2 (ZeRO-2, gradients sharded too): as DeepSpeed's stage 2 under gradient accumulation,
  each micro-batch's gradients are reduce-scattered as they are made and only the shard is
  kept; the buckets kept out of the overlap (partial sums over another group) once per step.
- 3 (ZeRO-3, weights sharded too): ZeRO-2's gradients, and between uses only the shard of each
  bucket's weights; inside its stage's UNSHARD .. RESHARD span a compute all-gathers them a
  block at a time and releases them after (``hybrid.planning.schedules.gathers``;
  ``parallel.zero3_reshard``). No gather follows the
  optimizer step: the next step's first UNSHARD gathers the updated shards.

Runtimes: ``hybrid.dp.sharding``.
"""

from __future__ import annotations

from hybrid.planning.cost.collectives import ring_all_reduce, ring_gather
from hybrid.planning.cost.state_bytes import FP32, STEP_COUNT_BYTES, StateBytes, bucket_sizes
from hybrid.planning.strategies.base import (
    RankTraffic, ShardingSpec, all_reduce_bytes, scatter_bytes,
)
from hybrid.planning.strategies.registry import register_sharding


class Replicated(ShardingSpec):
    stage, name, runtime = 0, "replicated", "hybrid.dp.sharding:Replicated"
    searched = True
    doc = "every DP rank keeps whole gradients and optimizer state (DDP)"

    def state_bytes(self, tensors, *, dp, dp_rank, bucket_mb):
        total = sum(numel for numel, _ in tensors)
        return StateBytes(FP32 * total, FP32 * total,
                          2 * FP32 * total + STEP_COUNT_BYTES * len(tensors))

    def closed_form_state(self, params, dp):
        return StateBytes(FP32 * params, FP32 * params, 2 * FP32 * params)

    def gradient_bytes(self, traffic, width):
        return sum(all_reduce_bytes(width * n, traffic.dp) for n in traffic.numels())

    def time(self, traffic, timing, width):
        grads = width * timing.params
        total = ring_all_reduce(grads, traffic.dp, timing.link, timing.buckets(grads))
        # the buckets reduce while the backward makes the next ones, but the last is ready
        # only when it ends: at least its reduction sticks out (PyTorch's DDP launches the
        # buckets in order, so it also waits behind whatever has not finished)
        last = ring_all_reduce(timing.last_bucket_bytes(width), traffic.dp, timing.link)
        return total, max(0.0, total - timing.backward, min(last, total))

    def choices(self):
        return [("exact", {})]


class Zero1(ShardingSpec):
    stage, name, runtime = 1, "zero-1", "hybrid.dp.sharding:Zero1"
    shards_optimizer = True
    searched = True
    doc = "optimizer state sharded over the gradient group; parameters all-gathered per step"

    def state_bytes(self, tensors, *, dp, dp_rank, bucket_mb):
        params = grads = optimizer = 0
        for bucket in bucket_sizes(tensors, bucket_mb):
            padded = -(-sum(bucket) // dp) * dp
            shard = padded // dp
            params += self._param_bytes(padded, shard)
            grads += self._grad_bytes(padded, shard, dp)
            optimizer += _shard_optimizer_bytes(bucket, dp_rank * shard, (dp_rank + 1) * shard)
        return StateBytes(params, grads, optimizer)

    @staticmethod
    def _param_bytes(padded: int, shard: int) -> int:
        """The bucket's flat parameters, whole (the model's parameters are views of them)."""
        return FP32 * padded

    @staticmethod
    def _grad_bytes(padded: int, shard: int, dp: int) -> int:
        """The full bucket buffer and, with more than one rank, this rank's reduced shard."""
        return FP32 * padded + (FP32 * shard if dp > 1 else 0)

    def closed_form_state(self, params, dp):
        return StateBytes(FP32 * params, FP32 * params, 2 * FP32 * params // dp)

    def scatters_per_step(self, traffic: RankTraffic, bucket: int) -> int:
        """How often bucket ``bucket`` is reduce-scattered in a step."""
        return 1

    def gathers_per_step(self, traffic: RankTraffic, bucket: int) -> int:
        """How often bucket ``bucket``'s parameters are all-gathered in a step."""
        return 1

    def gradient_bytes(self, traffic, width):
        dp = traffic.dp
        padded = [-(-n // dp) * dp for n in traffic.numels()]
        scatters = sum(scatter_bytes(width * n, dp) * self.scatters_per_step(traffic, i)
                       for i, n in enumerate(padded))
        return scatters + sum(scatter_bytes(FP32 * n, dp) * self.gathers_per_step(traffic, i)
                              for i, n in enumerate(padded))

    def collectives_per_step(self, traffic: RankTraffic) -> tuple[float, float]:
        """(reduce-scatters of the gradients, all-gathers of the weights) a step."""
        return 1, 1

    def time(self, traffic, timing, width):
        dp, link, device = traffic.dp, timing.link, timing.device
        grads = width * timing.params
        buckets = timing.buckets(grads)
        scatter = ring_gather(grads, dp, link, buckets) * device.reduce_scatter_factor
        gather = ring_gather(FP32 * timing.params, dp, link, buckets) * device.all_gather_factor
        scatters, gathers = self.collectives_per_step(traffic)
        # What the backward does not hide: each reduce-scatter's excess over one micro-batch's
        # backward, and every gather (ZeRO-3's prefetch overlaps one only where the previous
        # compute is another stage's, which the closed form does not know).
        return (scatters * scatter + gathers * gather,
                scatters * max(0.0, scatter - timing.backward) + gathers * gather)

    def choices(self):
        return [(f"zero={self.stage}", {"zero": self.stage})]


class Zero2(Zero1):
    stage, name, runtime = 2, "zero-2", "hybrid.dp.sharding:Zero2"
    shards_gradients = True
    searched = True
    doc = ("gradients sharded too: each micro-batch's reduce-scattered as it is made, only "
           "the shard kept")

    @staticmethod
    def _grad_bytes(padded, shard, dp):
        return FP32 * shard  # buckets are staged per micro-batch, then freed

    def closed_form_state(self, params, dp):
        return StateBytes(FP32 * params, FP32 * params // dp, 2 * FP32 * params // dp)

    def scatters_per_step(self, traffic, bucket):
        # the overlapped buckets once per micro-batch, the late ones (summed over another
        # group first) once per step
        return traffic.microbatches if bucket < traffic.overlapped() else 1

    def collectives_per_step(self, traffic):
        return traffic.microbatches, 1


class Zero3(Zero2):
    stage, name, runtime = 3, "zero-3", "hybrid.dp.sharding:Zero3"
    gathers_params = True
    searched = searched_if_less_fails = True
    doc = ("weights sharded too: gathered a block at a time for each compute, released after "
           "(parallel.zero3_reshard)")

    @staticmethod
    def _param_bytes(padded, shard):
        return FP32 * shard  # the shard's own buffer; the whole is gathered only while used

    def closed_form_state(self, params, dp):
        return StateBytes(FP32 * params // dp, FP32 * params // dp, 2 * FP32 * params // dp)

    def memory_floor(self, lower, dp):
        # ZeRO-2's gradients and optimizer state; its whole weights become shards, and the
        # gathered blocks come on top (at least nothing)
        return lower.total_bytes - lower.param_bytes + lower.param_bytes // dp

    def gathers_per_step(self, traffic, bucket):
        # the schedule's UNSHARD actions (``RankTraffic.gathers``)
        return 1 if traffic.gathers is None else traffic.gathers[bucket]

    def collectives_per_step(self, traffic):
        return traffic.microbatches, traffic.mean_gathers()

    def choices(self):
        return [(f"zero=3 {policy}", {"zero": 3, "zero3_reshard": policy})
                for policy in ("after_forward", "after_step")]


def _shard_optimizer_bytes(bucket: list[int], start: int, end: int) -> int:
    """AdamW's two moments and a step count for each parameter slice in ``[start, end)``."""
    optimizer, offset = 0, 0
    for numel in bucket:
        inside = min(end, offset + numel) - max(start, offset)
        if inside > 0:
            optimizer += 2 * FP32 * inside + STEP_COUNT_BYTES
        offset += numel
    return optimizer


REPLICATED = register_sharding(Replicated())
ZERO_1 = register_sharding(Zero1())
ZERO_2 = register_sharding(Zero2())
ZERO_3 = register_sharding(Zero3())
