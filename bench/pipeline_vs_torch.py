"""hybrid's pipeline runtime against torch.distributed.pipelining, side by side in one run.

    .venv/bin/python bench/pipeline_vs_torch.py                 # pp=4 on 4 gloo processes
    .venv/bin/python bench/pipeline_vs_torch.py --pp 2 --steps 4
    .venv/bin/python bench/pipeline_vs_torch.py --timeline docs/img   # also draw hybrid's steps

Both sides run the same GPT blocks (``build_blocks``, same seed: the very same module objects,
``torch.distributed.pipelining.PipelineStage`` wraps them), the same layout, micro-batch size
and micro-batch count, and the same loss; each pair of schedules alternates step by step so
that load from other processes hits both alike. Per schedule it prints the step's wall time
(the slowest rank; median and minimum over the timed steps) and CPU-seconds (all ranks
together, median); the last line is ``ratio=<hybrid/torch>`` of the summed median step times
(lower is better), after the same ratio of the minima, which a busy machine disturbs less.

Pairs: 1f1b / Schedule1F1B, interleaved-1f1b (vpp=2) / ScheduleInterleaved1F1B,
zb-h1 / ScheduleInterleavedZeroBubble with one stage per rank (ZB1P), zb-v (vpp=2, V placed:
rank r holds stages r and 2*pp-1-r) / ScheduleZBVZeroBubble. ``--schedules`` runs a subset.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.planning.config import ModelConfig  # noqa: E402
from hybrid.groups import ParallelGroups  # noqa: E402
from hybrid.planning.layout import Layout  # noqa: E402
from hybrid.model import build_blocks, lm_loss, num_blocks  # noqa: E402
from hybrid.planning.schedules.partition import partition  # noqa: E402
from hybrid.planning.schedules.rank_check import rank_stages  # noqa: E402
from hybrid.pipeline.recorder import ActionRecorder, gather_events, write_timeline  # noqa: E402
from hybrid.pipeline.runtime import run_pipeline_step  # noqa: E402
from hybrid.planning.schedules import (  # noqa: E402
    add_communication, build_schedule, schedule_placement,
)
from hybrid.testing import spawn  # noqa: E402

PAIRS = [("1f1b", 1, "Schedule1F1B"), ("interleaved-1f1b", 2, "ScheduleInterleaved1F1B"),
         ("zb-h1", 1, "ScheduleInterleavedZeroBubble"), ("zb-v", 2, "ScheduleZBVZeroBubble")]


def _torch_schedule(name, stages, m, loss_fn):
    from torch.distributed import pipelining

    cls = getattr(pipelining, name)
    return cls(stages[0] if name == "Schedule1F1B" else stages, m, loss_fn=loss_fn)


def _hybrid_runner(args, cfg, groups, chunks, name, vpp, batch, recorder=None):
    pp, m = args.pp, args.microbatches
    placement = schedule_placement(name)
    lists = add_communication(build_schedule(name, pp, m, vpp=vpp), pp, vpp, placement)
    tokens, labels = batch
    micro = list(zip(tokens.split(args.micro_batch), labels.split(args.micro_batch)))
    loss_fn = functools.partial(lm_loss, groups=groups, vocab=cfg.vocab)

    def step():
        return run_pipeline_step(
            lists[groups.pp_rank], chunks, micro, groups=groups, pp=pp, vpp=vpp,
            loss_fn=loss_fn, act_shape=(cfg.seq_len, args.micro_batch, cfg.hidden),
            act_dtype=torch.float32, recorder=recorder, placement=placement)
    return step, lists


def _torch_runner(args, cfg, groups, chunks, torch_name, batch):
    from torch.distributed.pipelining import PipelineStage

    pp, m = args.pp, args.microbatches
    n_stages = pp * len(chunks)
    stages = [PipelineStage(chunks[s], s, n_stages, groups.device, group=groups.pipeline.pg)
              for s in sorted(chunks)]
    schedule = _torch_schedule(torch_name, stages, m, functools.partial(lm_loss, groups=groups,
                                                                         vocab=cfg.vocab))
    tokens, labels = batch

    def step():
        losses = []
        inputs = (tokens,) if 0 in chunks else ()
        last = n_stages - 1 in chunks
        schedule.step(*inputs, target=labels if last else None, losses=losses)
        return float(torch.stack(losses).detach().mean()) if last else None
    return step


def _timed(step, groups, chunks):
    for chunk in chunks.values():
        chunk.zero_grad(set_to_none=True)
    dist.barrier(group=groups.pipeline.pg)
    wall, cpu = time.perf_counter(), time.process_time()
    loss = step()
    spans = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu])
    held = torch.tensor([0.0 if loss is None else loss])  # the last stage's rank has it
    dist.all_reduce(held, group=groups.pipeline.pg)
    dist.barrier(group=groups.pipeline.pg)
    wall_max = spans[:1].clone()
    dist.all_reduce(wall_max, op=dist.ReduceOp.MAX, group=groups.pipeline.pg)
    dist.all_reduce(spans, group=groups.pipeline.pg)
    return held.item(), wall_max.item(), spans[1].item()


def _bench_rank(rank, world, args):
    cfg = ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.heads,
                      seq_len=args.seq, vocab=256)
    groups = ParallelGroups.create(Layout(pp=args.pp))
    gen = torch.Generator().manual_seed(0)
    shape = (args.microbatches * args.micro_batch, args.seq)
    batch = (torch.randint(0, cfg.vocab, shape, generator=gen),
             torch.randint(0, cfg.vocab, shape, generator=gen))
    rows = []
    for name, vpp, torch_name in [p for p in PAIRS if p[0] in args.schedules]:
        stages = partition([1.0] * num_blocks(cfg), args.pp, vpp)
        held = rank_stages(groups.pp_rank, args.pp, vpp, schedule_placement(name))
        chunks = {s: nn.Sequential(*build_blocks(cfg, groups, seed=1, block_ids=list(stages[s])))
                  for s in held}
        hybrid_step, lists = _hybrid_runner(args, cfg, groups, chunks, name, vpp, batch)
        torch_step = _torch_runner(args, cfg, groups, chunks, torch_name, batch)
        times = {"hybrid": [], "torch": []}
        for step in range(args.steps + 1):  # step 0 warms up (torch infers shapes)
            for side, run in (("hybrid", hybrid_step), ("torch", torch_step)):
                loss, wall, cpu = _timed(run, groups, chunks)
                if step:
                    times[side].append((wall, cpu, loss))
        rows.append((name, torch_name, times))
        if args.timeline:
            _draw(args, cfg, groups, chunks, name, vpp, batch)
    return rows if groups.pp_rank == 0 else None  # every rank has the reduced figures


def _draw(args, cfg, groups, chunks, name, vpp, batch):
    recorder = ActionRecorder(groups.pp_rank)
    step, lists = _hybrid_runner(args, cfg, groups, chunks, name, vpp, batch, recorder)
    dist.barrier(group=groups.pipeline.pg)
    step()
    events = gather_events(recorder.events, group=groups.pipeline, dst=groups.pipeline.ranks[0])
    if events is not None:
        prefix = Path(args.timeline) / f"timeline_{name}_pp{args.pp}"
        report = write_timeline(events, lists, prefix, pp=args.pp, m=args.microbatches,
                                placement=schedule_placement(name),
                                vpp=vpp, title=f"hybrid {name}, pp={args.pp}, m="
                                               f"{args.microbatches}")
        print(f"{prefix}.png: measured bubble {report['measured']:.1%}, simulated with the "
              f"measured action times {report['simulated']:.1%}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--timeline", default="", help="folder for hybrid's timeline PNGs")
    parser.add_argument("--schedules", nargs="+", default=[p[0] for p in PAIRS],
                        choices=[p[0] for p in PAIRS], help="hybrid schedules to pair")
    args = parser.parse_args()
    print(f"pp={args.pp} gloo processes, {args.layers} layers, hidden {args.hidden}, seq "
          f"{args.seq}, micro-batch {args.micro_batch} x {args.microbatches}, "
          f"{args.steps} timed steps per side", flush=True)
    rows = next(r for r in spawn(_bench_rank, args.pp, args, timeout=3600) if r is not None)
    totals = {"hybrid": [0.0, 0.0], "torch": [0.0, 0.0]}  # sums of medians, of minima
    for name, torch_name, times in rows:
        pair = {}
        for side, label in (("hybrid", f"hybrid {name}"), ("torch", f"torch {torch_name}")):
            walls = [t[0] for t in times[side]]
            wall, fastest = statistics.median(walls), min(walls)
            cpu = statistics.median(t[1] for t in times[side])
            totals[side][0] += wall
            totals[side][1] += fastest
            pair[side] = (wall, fastest)
            print(f"{label:38s} step {wall * 1e3:7.1f} ms (min {fastest * 1e3:7.1f})   "
                  f"cpu {cpu:5.2f} s   loss {times[side][-1][2]:.5f}", flush=True)
        print(f"{'':38s} {name} ratio={pair['hybrid'][0] / pair['torch'][0]:.3f} "
              f"(of minima {pair['hybrid'][1] / pair['torch'][1]:.3f})")
    print(f"ratio of minima={totals['hybrid'][1] / totals['torch'][1]:.3f}")
    print(f"ratio={totals['hybrid'][0] / totals['torch'][0]:.3f}")

if __name__ == "__main__":
    main()
