"""Context parallelism: one training step of a GPT at cp=2 against the same step at cp=1, in one
run, with keys and values passed around the ring (p2p) and all-gathered.

    .venv/bin/python bench/cp_attention.py
    .venv/bin/python bench/cp_attention.py --seq 4096 --steps 4

Two gloo processes, one thread each, fp32, the same model and sequence on every side:

- cp1: each process runs the whole sequence alone (``Layout()``: two independent 1-rank
  models, so both cores work, as the cp=2 sides' two ranks do);
- cp2-p2p / cp2-allgather: ``Layout(cp=2)``, each rank its zigzag half of the sequence, and the
  gradients all-reduced over the context group at the end of the step, as a cp=2 job does.

A step is zero-grad + forward + backward (+ that all-reduce). Sides alternate; 1 warm-up step,
then the median wall time of the slowest rank. "bytes" are what one rank sends over its context
group per step, counted by ``hybrid.comm.CommCounter`` beside ``cp_step_bytes``' prediction.
"no-ring" is the same step with the ring's messages and collectives replaced by local copies
(bench-only stubs: the same compute, no communication); "ring alone" is one step's messages
replayed back to back with no compute; "hidden" is ``1 - (step - no-ring) / ring alone``, the
share of the ring's own time the step did not pay. The last line is
``ratio=<cp2-p2p step / cp1 step>``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.comm import CommCounter  # noqa: E402
from hybrid.groups import ParallelGroups  # noqa: E402
from hybrid.model import GPT  # noqa: E402
from hybrid.model import context as context_module  # noqa: E402
from hybrid.model.context import context_slice  # noqa: E402
from hybrid.planning.config import Config, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from hybrid.planning.cost.context_time import cp_step_bytes, kv_block_bytes  # noqa: E402
from hybrid.planning.layout import Layout  # noqa: E402
from hybrid.testing import spawn  # noqa: E402

SIDES = {"cp1": (1, "p2p"), "cp2-p2p": (2, "p2p"), "cp2-allgather": (2, "allgather")}


def _config(args, cp: int, comm: str) -> Config:
    model = ModelConfig(name="bench", layers=args.layers, hidden=args.hidden, heads=args.heads,
                        vocab=256, vocab_pad_multiple=64, seq_len=args.seq)
    return Config(model=model, train=TrainConfig(micro_batch=1, global_batch=1),
                  parallel=ParallelConfig(cp=cp, cp_comm=comm))


class _Side:
    def __init__(self, args, name: str):
        cp, comm = SIDES[name]
        self.cfg, self.cp = _config(args, cp, comm), cp
        self.groups = ParallelGroups.create(Layout(cp=cp))
        self.model = GPT(self.cfg.model, self.groups, seed=1, cp_comm=comm)
        tokens = torch.randint(0, 256, (1, args.seq + 1), generator=torch.Generator()
                               .manual_seed(3))
        rank = self.groups.context.rank()
        self.x = context_slice(tokens[:, :-1], cp, rank)
        self.y = context_slice(tokens[:, 1:], cp, rank)
        self.counter = CommCounter(self.groups)

    def step(self) -> float:
        self.model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with self.counter.track():
            self.model(self.x, self.y).backward()
            if self.cp > 1:
                flat = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])
                self.groups.gradient.all_reduce(flat)
        return time.perf_counter() - start


def _ring_alone(side: _Side, steps: int) -> float:
    """The ring's messages of one step, back to back with no compute (seconds, median)."""
    if side.cp == 1:
        return 0.0
    ring = context_module._Ring(side.groups.context, zigzag=True)
    block = torch.zeros(kv_block_bytes(side.cfg, Layout(cp=side.cp)) // 4)
    per_step = round(side.counter.snapshot()["cp"]["bytes"] / (block.numel() * 4))
    times = []
    for _ in range(steps):
        side.groups.world.barrier()
        start = time.perf_counter()
        if side.cfg.parallel.cp_comm == "p2p":
            for _ in range(per_step):
                context_module._received(ring._pass_on(block))
        else:
            passes = per_step // (side.cp - 1)
            out = torch.empty(side.cp * block.numel())
            for i in range(passes):
                if i % 3 == 2:  # every third collective of a layer is a reduce-scatter
                    side.groups.context.reduce_scatter_into(block, out)
                else:
                    side.groups.context.all_gather_into(out, block)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _NoRing:
    """Inside the block the ring sends nothing: each pass hands a rank its own block back and
    the collectives copy locally, so a step does the same compute and no communication."""

    def __init__(self, side: _Side):
        self.group = side.groups.context

    def __enter__(self):
        self.saved = context_module._Ring._pass_on
        context_module._Ring._pass_on = lambda ring, tensor, tag=0: ([], tensor.clone(), tensor)
        cp = self.group.size()
        self.group.all_gather_into = lambda out, t: out.copy_(t.reshape(-1).repeat(cp)
                                                              .view_as(out))
        self.group.reduce_scatter_into = lambda out, t: out.copy_(t.chunk(cp)[0].view_as(out))

    def __exit__(self, *exc):
        context_module._Ring._pass_on = self.saved
        del self.group.all_gather_into, self.group.reduce_scatter_into


def _job(rank: int, world: int, args) -> dict:
    torch.set_num_threads(1)
    sides = {name: _Side(args, name) for name in SIDES}
    times = {name: [] for name in SIDES}
    alone = {name: [] for name in SIDES}
    for i in range(args.steps + 1):
        for name, side in sides.items():
            side.groups.world.barrier()
            side.counter.reset()
            elapsed = side.step()
            side.groups.world.barrier()
            with _NoRing(side):
                compute = side.step()
            if i:  # the first step warms up
                times[name].append(elapsed)
                alone[name].append(compute)
    out = {}
    for name, side in sides.items():
        predicted = cp_step_bytes(side.cfg, Layout(cp=side.cp), args.layers, 1)
        side.counter.reset()
        side.step()  # count one step's bytes again (the compute-only step counted none)
        out[name] = {"step_s": statistics.median(times[name]),
                     "compute_s": statistics.median(alone[name]),
                     "bytes": side.counter.snapshot()["cp"]["bytes"], "predicted": predicted,
                     "alone_s": _ring_alone(side, 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    results = spawn(_job, 2, args, timeout=600)
    print(f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, one sequence "
          f"of {args.seq} tokens, fp32, 2 gloo ranks x 1 thread; median of {args.steps} steps")
    print(f"{'side':<14} {'step s':>8} {'no-ring s':>9} {'cp bytes':>11} {'predicted':>11} "
          f"{'ring alone s':>12} {'hidden':>7}")
    for name in SIDES:
        r = {k: max(rank[name][k] for rank in results) for k in results[0][name]}
        exposed = max(0.0, r["step_s"] - r["compute_s"])
        hidden = f"{max(0.0, 1 - exposed / r['alone_s']):.0%}" if r["alone_s"] else "-"
        print(f"{name:<14} {r['step_s']:>8.4f} {r['compute_s']:>9.4f} {r['bytes']:>11,.0f} "
              f"{r['predicted']:>11,.0f} {r['alone_s']:>12.4f} {hidden:>7}")
        assert r["bytes"] == r["predicted"], (name, r["bytes"], r["predicted"])
    one = max(rank["cp1"]["step_s"] for rank in results)
    for name in ("cp2-allgather", "cp2-p2p"):
        step = max(rank[name]["step_s"] for rank in results)
        print(f"{name} / cp1 step time: ratio={step / one:.3f}")


if __name__ == "__main__":
    main()
