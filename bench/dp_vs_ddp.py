"""hybrid's DP gradient sync against torch ``DistributedDataParallel``, side by side in one run.

    .venv/bin/python bench/dp_vs_ddp.py                      # 2 gloo ranks, small GPT
    .venv/bin/python bench/dp_vs_ddp.py --steps 6 --microbatches 2 --hidden 256

Both sides train the same small GPT (``hybrid.model.GPT``, same seed, tp=pp=1) on the same
batches, in the same 2 gloo processes, with the same AdamW, LR schedule and gradient clipping:

- hybrid: ``GradSync`` (25 MiB buckets, async all-reduce started from the last micro-batch's
  backward, fp32 bucket views as ``.grad``);
- torch: ``DistributedDataParallel(bucket_cap_mb=25, gradient_as_bucket_view=True)`` with
  ``no_sync()`` on every micro-batch but the last, then ``clip_grad_norm_`` and ``step``.

Steps alternate between the two (hybrid, ddp, hybrid, ...) so that load from other processes
hits both alike; the first step of each is a warm-up and is not timed. Per side it prints the
median wall time per step (the slowest rank) and the median CPU-seconds per step of all ranks
together (``time.process_time``, which includes gloo's communication threads). The last line
is ``ratio=<hybrid/ddp>`` of the median CPU-seconds per step (lower is better; CPU time is used
because on a shared machine it is steadier than wall time, which is printed too).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.planning.config import ModelConfig, OptimConfig  # noqa: E402
from hybrid.dp import GradSync  # noqa: E402
from hybrid.groups import ParallelGroups  # noqa: E402
from hybrid.planning.layout import Layout  # noqa: E402
from hybrid.model import GPT  # noqa: E402
from hybrid.optim import build_adamw, lr_at, set_lr, spec_of  # noqa: E402
from hybrid.testing import spawn  # noqa: E402

OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2)
CLIP, SEED, BUCKET_MB = 1.0, 7, 25.0


def model_config(args) -> ModelConfig:
    return ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=256,
                       seq_len=args.seq_len, tie_embeddings=True)


def batch(step: int, args, dp_rank: int, dp: int):
    """This DP rank's micro-batches of the global batch of ``step``."""
    gen = torch.Generator().manual_seed(step)
    rows = dp * args.microbatches * args.micro_batch
    tokens = torch.randint(0, 256, (rows, args.seq_len + 1), generator=gen)
    mine = tokens.chunk(dp)[dp_rank]
    return [(t[:, :-1], t[:, 1:]) for t in mine.split(args.micro_batch)]


def hybrid_step(model, sync, micro, lr) -> float:
    sync.start_step(len(micro))
    losses = []
    for tokens, labels in micro:
        loss = model(tokens, labels)
        (loss / len(micro)).backward()
        losses.append(loss.item())
    sync.finish_step(lr=lr, max_norm=CLIP)
    return sum(losses) / len(losses)


def ddp_step(ddp, optimizer, micro, lr) -> float:
    losses = []
    for index, (tokens, labels) in enumerate(micro):
        last = index == len(micro) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            loss = ddp(tokens, labels)
            (loss / len(micro)).backward()
        losses.append(loss.item())
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
    set_lr(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return sum(losses) / len(losses)


def _worker(rank, world, args):
    from torch.nn.parallel import DistributedDataParallel

    groups = ParallelGroups.create(Layout(dp=world))
    cfg = model_config(args)
    hybrid_model = GPT(cfg, groups, seed=SEED)
    sync = GradSync(hybrid_model, groups, OPTIM, bucket_mb=BUCKET_MB)
    torch_model = GPT(cfg, groups, seed=SEED)
    ddp = DistributedDataParallel(torch_model, process_group=groups.gradient.pg, bucket_cap_mb=BUCKET_MB,
                                  gradient_as_bucket_view=True)
    optimizer = build_adamw([(p, spec_of(p, n).weight_decay)
                             for n, p in torch_model.named_parameters()], OPTIM)
    runners = {"hybrid": lambda micro, lr: hybrid_step(hybrid_model, sync, micro, lr),
               "ddp": lambda micro, lr: ddp_step(ddp, optimizer, micro, lr)}
    record = {name: {"wall": [], "cpu": [], "loss": []} for name in runners}
    for step in range(1, args.steps + 2):  # step 1 is the warm-up
        micro = batch(step, args, groups.data.rank(), world)
        lr = lr_at(step, OPTIM, args.steps + 1)
        for name, run in runners.items():
            groups.gradient.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            loss = run(micro, lr)
            record[name]["wall"].append(time.perf_counter() - wall)
            record[name]["cpu"].append(time.process_time() - cpu)
            record[name]["loss"].append(loss)
    params = sum(p.numel() for p in hybrid_model.parameters())
    return record, params, len(sync.buckets)


def summarise(results, args) -> None:
    records = [r[0] for r in results]
    params, buckets = results[0][1], results[0][2]
    print(f"GPT layers={args.layers} hidden={args.hidden} seq={args.seq_len}: {params:,} params "
          f"({params * 4 / 2**20:.1f} MiB of fp32 gradients, {buckets} hybrid buckets); "
          f"dp={len(records)} on gloo, {args.microbatches} micro-batches of {args.micro_batch} "
          f"per step, {args.steps} timed steps")
    medians = {}
    for name in ("hybrid", "ddp"):
        walls = [max(r[name]["wall"][s] for r in records) for s in range(1, args.steps + 1)]
        cpus = [sum(r[name]["cpu"][s] for r in records) for s in range(1, args.steps + 1)]
        losses = [sum(r[name]["loss"][s] for r in records) / len(records)
                  for s in range(args.steps + 1)]
        medians[name] = (statistics.median(walls), statistics.median(cpus))
        print(f"{name:>6}: step wall {medians[name][0] * 1e3:8.1f} ms   step CPU "
              f"{medians[name][1]:7.3f} s (all ranks)   loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"wall ratio={medians['hybrid'][0] / medians['ddp'][0]:.3f}")
    print(f"ratio={medians['hybrid'][1] / medians['ddp'][1]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    results = spawn(_worker, args.ranks, args, timeout=3600)
    summarise(results, args)


if __name__ == "__main__":
    main()
