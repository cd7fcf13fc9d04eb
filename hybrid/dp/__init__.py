"""Data parallelism: bucketed gradient sync in the DP group, other-axis reductions, global
gradient clipping, AdamW and ZeRO-1, behind one object, ``GradSync``.

The training loop, per optimizer step (``step`` is 1-based)::

    sync = GradSync.from_config(model_or_chunks, groups, cfg)      # once
    counter = CommCounter(groups)                                  # once (hybrid.comm)

    with counter.track():
        sync.start_step(num_microbatches)
        ...  # every micro-batch's forward and backward of loss / num_microbatches
        grad_norm = sync.finish_step(lr=lr_at(step, cfg.optim, cfg.train.steps),
                                     max_norm=cfg.train.grad_clip)
    comm = counter.snapshot(); counter.reset()

``finish_step`` = ``reduce_gradients()``, ``clip_grad_norm_(max_norm)``,
``optimizer_step(lr)``, ``zero_grad()``; the four are public for loops that need them apart.
"""

from hybrid.dp.buckets import Bucket, Piece, plan_buckets, reduce_first_axis
from hybrid.dp.clip import clip_coefficient, counts_in_norm, global_grad_norm
from hybrid.dp.sync import DataParallelConfigError, GradSync
from hybrid.dp.zero import Shard, all_gather_params

__all__ = [
    "GradSync", "DataParallelConfigError", "reduce_first_axis",
    "Bucket", "Piece", "plan_buckets",
    "counts_in_norm", "global_grad_norm", "clip_coefficient",
    "Shard", "all_gather_params",
]
