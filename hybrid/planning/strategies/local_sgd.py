"""Local SGD (pure): ``parallel.dp_sync_every=H``. Each replica steps on its own gradients;
every H-th step the replicas' parameters (and with ``dp_sync_moments`` AdamW's two moments) are
averaged, one all-reduce per bucket and kind, not hidden, its time spread over the H steps.
Runtime: ``hybrid.dp.replicas.LocalSGD``."""

from __future__ import annotations

from hybrid.planning.cost.state_bytes import FP32
from hybrid.planning.strategies.base import ReductionSpec, all_reduce_bytes
from hybrid.planning.strategies.registry import register_reduction


class LocalSGD(ReductionSpec):
    name, runtime = "local-sgd", "hybrid.dp.replicas:LocalSGD"
    grad_width, shardings = None, (0,)
    doc = "replicas step alone and average parameters every H steps"

    def setting(self, options):
        return f"dp_sync_every={options.sync_every}" if options.sync_every > 1 else None

    def field_problem(self, options):
        every = options.sync_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            return f"parallel.dp_sync_every={every!r} must be an integer >= 1"
        if options.sync_moments and every == 1:
            return ("parallel.dp_sync_moments=true does nothing with parallel.dp_sync_every=1 "
                    "(every step is exact): set dp_sync_every > 1 or drop it")
        return None

    def run_problem(self, options, *, steps, checkpoint_every):
        every, saves = options.sync_every, checkpoint_every
        if steps % every:
            return (f"train.steps={steps} is not a multiple of parallel.dp_sync_every={every}: "
                    f"the run would end with replicas that disagree; set train.steps="
                    f"{every * -(-steps // every)}")
        if saves > 0 and not options.sync_moments:
            return (f"parallel.dp_sync_every={every} leaves each replica its own AdamW "
                    f"moments, which a checkpoint cannot hold: set parallel.dp_sync_moments=true "
                    f"or checkpoint.every=0")
        if saves % every:
            return (f"checkpoint.every={saves} is not a multiple of parallel.dp_sync_every="
                    f"{every}: replicas agree only after a sync; set checkpoint.every="
                    f"{every * max(1, saves // every)}")
        return None

    def cycle(self, options):
        return options.sync_every

    def step_bytes(self, traffic, options, step, sharding):
        if step % options.sync_every:
            return 0.0
        copies = 3 if options.sync_moments else 1
        return sum(all_reduce_bytes(FP32 * n * copies, traffic.dp) for n in traffic.numels())

    def time(self, traffic, timing, options, sharding):
        dp, link = traffic.dp, timing.link
        latency = 2 * (dp - 1) * link.latency * max(1, len(traffic.buckets()))
        copies = 3 if options.sync_moments else 1
        sync = self.step_bytes(traffic, options, options.sync_every, sharding)
        each = (sync / link.bandwidth + latency * copies) / options.sync_every
        return each, each

    def choices(self):
        return [(f"sync_every {h}", {"dp_sync_every": h}) for h in (2, 4, 8)]


LOCAL_SGD = register_reduction(LocalSGD())
