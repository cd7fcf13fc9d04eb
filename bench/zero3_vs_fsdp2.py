"""hybrid's ZeRO-3 against torch FSDP2 (``fully_shard`` per block), same model, data, optimizer.

    .venv/bin/python bench/zero3_vs_fsdp2.py                 # dp2 and dp4, small GPT
    .venv/bin/python bench/zero3_vs_fsdp2.py --ranks 2 --hidden 512 --steps 6

Both sides train the same GPT (``hybrid.model.GPT``, tp=pp=1, same seed) on the same batches
with the same AdamW, LR schedule and clipping, over ``--ranks`` gloo processes:

- hybrid: ``GradSync(zero=3)`` with 4 MiB buckets (``--bucket-mb``; a block is 12 MiB of
  fp32 weights): each rank keeps its shard of every bucket; inside each micro-batch's forward
  and backward each block is gathered, with the next one behind it, and released after
  (``parallel.zero3_reshard=after_forward``; the stage's UNSHARD/RESHARD actions at pp=1 are
  the calls around them); gradients reduce-scattered per micro-batch (ZeRO-2's staging);
- torch: ``fully_shard`` on every block and on the root, ``reshard_after_forward=True``, with
  gradient sync on the last micro-batch only (``set_requires_gradient_sync``), then
  ``clip_grad_norm_`` and AdamW on the DTensor shards.

Each side runs in processes of its own (so that each one's peak memory is its own): per side
the median step wall time (slowest rank, first step a warm-up) and the peak resident memory of
the ranks' processes beyond what they held before building the model (``ru_maxrss``). The last
line is ``ratio=<hybrid/FSDP2 median step time>`` at ``--ranks 2``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.dp import GradSync  # noqa: E402
from hybrid.groups import ParallelGroups  # noqa: E402
from hybrid.model import GPT  # noqa: E402
from hybrid.optim import build_adamw, lr_at, set_lr, spec_of  # noqa: E402
from hybrid.planning.config import ModelConfig, OptimConfig  # noqa: E402
from hybrid.planning.layout import Layout  # noqa: E402
from hybrid.testing import spawn  # noqa: E402

OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2)
CLIP, SEED = 1.0, 7


def batch(step: int, args, dp_rank: int, dp: int):
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (dp * args.microbatches * args.micro_batch,
                                    args.seq_len + 1), generator=gen)
    mine = tokens.chunk(dp)[dp_rank]
    return [(t[:, :-1], t[:, 1:]) for t in mine.split(args.micro_batch)]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _hybrid(model, groups, args):
    sync = GradSync(model, groups, OPTIM, zero=3, bucket_mb=args.bucket_mb)
    weights = sync.stage_weights({0: model})

    def step(micro, lr) -> float:
        sync.start_step(len(micro))
        losses = []
        for tokens, labels in micro:
            weights.unshard(0)
            weights.ready(0)
            loss = model(tokens, labels)
            weights.reshard(0)
            weights.unshard(0)
            weights.ready(0)
            (loss / len(micro)).backward()
            weights.reshard(0)
            losses.append(loss.item())
        sync.finish_step(lr=lr, max_norm=CLIP)
        return sum(losses) / len(losses)
    return step


def _fsdp2(model, groups, args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (groups.layout.dp,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    optimizer = build_adamw([(p, spec_of(p, n).weight_decay)
                             for n, p in model.named_parameters()], OPTIM)

    def step(micro, lr) -> float:
        losses = []
        for index, (tokens, labels) in enumerate(micro):
            model.set_requires_gradient_sync(index == len(micro) - 1)
            loss = model(tokens, labels)
            (loss / len(micro)).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        set_lr(optimizer, lr)
        optimizer.step()
        optimizer.zero_grad()
        return sum(losses) / len(losses)
    return step


SIDES = {"hybrid": _hybrid, "fsdp2": _fsdp2}


def _worker(rank, world, side, args):
    groups = ParallelGroups.create(Layout(dp=world))
    before = _rss_mib()
    cfg = ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=256,
                      seq_len=args.seq_len)
    model = GPT(cfg, groups, seed=SEED)
    params = sum(p.numel() for p in model.parameters())
    run = SIDES[side](model, groups, args)
    walls, losses = [], []
    for step in range(1, args.steps + 2):  # step 1 is the warm-up
        micro = batch(step, args, groups.data.rank(), world)
        groups.gradient.barrier()
        start = time.perf_counter()
        losses.append(run(micro, lr_at(step, OPTIM, args.steps + 1)))
        walls.append(time.perf_counter() - start)
    return walls, losses, _rss_mib() - before, params


def measure(side: str, ranks: int, args) -> dict:
    results = spawn(_worker, ranks, side, args, timeout=3600)
    walls = [max(r[0][s] for r in results) for s in range(1, args.steps + 1)]
    losses = [sum(r[1][s] for r in results) / ranks for s in range(args.steps + 1)]
    return {"wall": statistics.median(walls), "mem": max(r[2] for r in results),
            "loss": (losses[0], losses[-1]), "params": results[0][3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    args = parser.parse_args()
    ratio = None
    for ranks in args.ranks:
        rows = {side: measure(side, ranks, args) for side in SIDES}
        print(f"dp{ranks}: GPT layers={args.layers} hidden={args.hidden} "
              f"({rows['hybrid']['params']:,} params), {args.microbatches} micro-batches of "
              f"{args.micro_batch} x {args.seq_len}, {args.steps} timed steps")
        for side, row in rows.items():
            print(f"  {side:>6}: step {row['wall'] * 1e3:8.1f} ms   peak RSS beyond start "
                  f"{row['mem']:7.1f} MiB   loss {row['loss'][0]:.4f} -> {row['loss'][1]:.4f}")
        ratio = rows["hybrid"]["wall"] / rows["fsdp2"]["wall"]
        print(f"  dp{ranks} memory ratio={rows['hybrid']['mem'] / rows['fsdp2']['mem']:.3f}"
              f"   step time ratio={ratio:.3f}")
    print(f"ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
