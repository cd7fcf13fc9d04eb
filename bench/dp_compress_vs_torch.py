"""hybrid's PowerSGD against torch DDP's PowerSGD communication hook, side by side in one run.

    .venv/bin/python bench/dp_compress_vs_torch.py                # rank 2, 10 exact steps
    .venv/bin/python bench/dp_compress_vs_torch.py --rank 1 --warmup 4 --steps 30

Three sides train the same GPT (``hybrid.model.GPT``, tp=pp=1, same seed; 4 layers, hidden
256, sequence 128 by default: 3.3M parameters, 12.7 MiB of fp32 gradients) in the same 2 gloo
processes (one intra-op thread each), on the same batches of the main job's generated data,
with the main job's AdamW and learning-rate schedule (``OptimConfig()``, ``lr_at``), the same
micro-batches and global-norm clipping at 1.0, all in fp32:

- ``hybrid powersgd``: ``GradSync(options=DpOptions(compress="powersgd", powersgd_rank=r,
  powersgd_warmup=w))``, 25 MiB buckets;
- ``torch powersgd``: ``DistributedDataParallel(bucket_cap_mb=25, gradient_as_bucket_view=True)``
  with ``powerSGD_hook`` and ``PowerSGDState(matrix_approximation_rank=r,
  start_powerSGD_iter=w, min_compression_rate=2, use_error_feedback=True, warm_start=True)``
  (hybrid's rules: the same matrices compressed, error feedback, warm-started Q); ``no_sync()``
  on every micro-batch but the last, then ``clip_grad_norm_`` and AdamW;
- ``hybrid exact``: ``GradSync`` with exact fp32 reduction, for reference.

Both PowerSGD sides reduce the first ``w`` steps exactly (torch counts its iterations in the
hook and refuses ``w < 2`` with error feedback or warm start). Each step runs the three sides
one after another, in an order that rotates every step so that load from other processes hits
all alike; steps ``1..w+1`` (exact steps, torch's bucket rebuild, the first compressed step's
allocations) are not timed. DP bytes: a ``hybrid.comm.CommCounter`` around each side's step
counts every collective on the DP group (DDP and the PowerSGD state are given that group, so
they count as ``dp``), compared with ``hybrid.planning.cost.dp_traffic.gradient_bytes``' prediction.

Per side: the median step wall time (the slower rank), the median CPU seconds per step (both
ranks, gloo's threads included), DP bytes rank 0 sent per timed step, and the final loss (mean
of the last 5 steps, each the mean over ranks). Last line: ``ratio=<hybrid/torch median step
wall time>`` of the two PowerSGD sides (lower is better).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.comm import CommCounter  # noqa: E402
from hybrid.planning.config import ModelConfig, OptimConfig  # noqa: E402
from hybrid.data import MarkovDataset, rank_microbatches  # noqa: E402
from hybrid.dp import GradSync  # noqa: E402
from hybrid.planning.cost.dp_traffic import gradient_bytes  # noqa: E402
from hybrid.planning.strategies import DpOptions  # noqa: E402
from hybrid.planning.strategies.powersgd import MIN_COMPRESSION  # noqa: E402
from hybrid.groups import ParallelGroups  # noqa: E402
from hybrid.planning.layout import Layout  # noqa: E402
from hybrid.optim import build_adamw, lr_at, spec_of  # noqa: E402
from hybrid.planning.cost.state_bytes import rank_shapes  # noqa: E402
from hybrid.testing import spawn  # noqa: E402
from dp_vs_ddp import ddp_step, hybrid_step  # noqa: E402  (bench/ is the script's path)

OPTIM = OptimConfig()  # the main job's: peak 3e-3, 10 warm-up steps, cosine to 3e-4
DP, SEED, BUCKET_MB, SAMPLES, LAST = 2, 1234, 25.0, 4096, 5  # clipping: dp_vs_ddp.CLIP
SIDES = ("hybrid powersgd", "torch powersgd", "hybrid exact")


def model_config(args) -> ModelConfig:
    return ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=256,
                       seq_len=args.seq_len)


def torch_powersgd(cfg: ModelConfig, groups, args):
    """DDP with torch's PowerSGD hook on the DP group, and its AdamW."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
        PowerSGDState, powerSGD_hook)
    from torch.nn.parallel import DistributedDataParallel

    from hybrid.model import GPT

    model = GPT(cfg, groups, seed=SEED)
    ddp = DistributedDataParallel(model, process_group=groups.gradient.pg, bucket_cap_mb=BUCKET_MB,
                                  gradient_as_bucket_view=True)
    state = PowerSGDState(process_group=groups.gradient.pg, matrix_approximation_rank=args.rank,
                          start_powerSGD_iter=args.warmup,
                          min_compression_rate=MIN_COMPRESSION,
                          use_error_feedback=True, warm_start=True)
    ddp.register_comm_hook(state, powerSGD_hook)
    optimizer = build_adamw([(p, spec_of(p, n).weight_decay)
                             for n, p in model.named_parameters()], OPTIM)
    return partial(ddp_step, ddp, optimizer)


def build_sides(groups, args) -> dict:
    from hybrid.model import GPT

    cfg = model_config(args)
    powersgd = DpOptions(compress="powersgd", powersgd_rank=args.rank,
                         powersgd_warmup=args.warmup)
    hybrid_model, exact_model = GPT(cfg, groups, seed=SEED), GPT(cfg, groups, seed=SEED)
    return {
        "hybrid powersgd": partial(hybrid_step, hybrid_model, GradSync(
            hybrid_model, groups, OPTIM, bucket_mb=BUCKET_MB, options=powersgd)),
        "torch powersgd": torch_powersgd(cfg, groups, args),
        "hybrid exact": partial(hybrid_step, exact_model, GradSync(
            exact_model, groups, OPTIM, bucket_mb=BUCKET_MB)),
    }


def _worker(rank: int, world: int, args) -> dict:
    groups = ParallelGroups.create(Layout(dp=world))
    sides = build_sides(groups, args)
    data = MarkovDataset(vocab=256, seq_len=args.seq_len, samples=SAMPLES, seed=SEED)
    counter = CommCounter(groups)
    record = {name: {"wall": [], "cpu": [], "bytes": [], "loss": []} for name in SIDES}
    for step in range(1, args.steps + 1):
        micro = rank_microbatches(data, step - 1, global_batch=args.global_batch,
                                  micro_batch=args.micro_batch, dp=world,
                                  dp_rank=groups.data.rank(), seed=SEED)
        lr = lr_at(step, OPTIM, args.steps)
        turn = step % len(SIDES)
        for name in SIDES[turn:] + SIDES[:turn]:
            groups.gradient.barrier()
            with counter.track():
                wall, cpu = time.perf_counter(), time.process_time()
                loss = sides[name](micro, lr)  # GradSync counts its steps from 1
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            for key, value in (("wall", wall), ("cpu", cpu), ("loss", loss),
                               ("bytes", counter.snapshot()["dp"]["bytes"])):
                record[name][key].append(value)
            counter.reset()
    return record


def predicted_bytes(args, options: DpOptions, step: int) -> float:
    cfg = model_config(args)
    shapes = rank_shapes(cfg, list(range(cfg.layers + 2)), tp=1, sp=False, pp=1)
    microbatches = args.global_batch // (DP * args.micro_batch)
    return gradient_bytes(shapes, dp=DP, options=options, step=step,
                          microbatches=microbatches, bucket_mb=BUCKET_MB)


def summarise(records: list[dict], args) -> None:
    timed = range(args.warmup + 1, args.steps)  # 0-based: steps w+2..steps
    cfg = model_config(args)
    print(f"GPT layers={cfg.layers} hidden={cfg.hidden} seq={cfg.seq_len}, dp={DP} on gloo, "
          f"global batch {args.global_batch} in micro-batches of {args.micro_batch}, "
          f"PowerSGD rank {args.rank} after {args.warmup} exact steps, {args.steps} steps "
          f"({len(timed)} timed)")
    medians = {}
    for name in SIDES:
        walls = [max(r[name]["wall"][s] for r in records) for s in timed]
        cpus = [sum(r[name]["cpu"][s] for r in records) for s in timed]
        losses = [statistics.mean(r[name]["loss"][s] for r in records)
                  for s in range(args.steps)]
        sent = statistics.mean(records[0][name]["bytes"][s] for s in timed)
        medians[name] = statistics.median(walls)
        print(f"{name:>16}: step {medians[name] * 1e3:7.1f} ms   CPU "
              f"{statistics.median(cpus):6.3f} s/step (both ranks)   DP "
              f"{sent / 2**20:7.3f} MiB/step   loss {losses[0]:.4f} -> final "
              f"{statistics.mean(losses[-LAST:]):.4f}")
    compressed = DpOptions(compress="powersgd", powersgd_rank=args.rank,
                           powersgd_warmup=args.warmup)
    print(f"predicted DP MiB/step (hybrid.planning.cost.dp_traffic): powersgd "
          f"{predicted_bytes(args, compressed, args.steps) / 2**20:.3f}, exact "
          f"{predicted_bytes(args, DpOptions(), args.steps) / 2**20:.3f}")
    print(f"ratio={medians['hybrid powersgd'] / medians['torch powersgd']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD's rank r")
    parser.add_argument("--warmup", type=int, default=10, help="exact steps first (>= 2)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    if args.warmup < 2:
        parser.error("--warmup must be >= 2: torch's PowerSGD hook refuses fewer exact steps "
                     "with error feedback or warm start")
    if args.steps < args.warmup + 2 + LAST:
        parser.error(f"--steps must be >= warmup + {2 + LAST} to time compressed steps")
    summarise(spawn(_worker, DP, args, timeout=3600), args)


if __name__ == "__main__":
    main()
