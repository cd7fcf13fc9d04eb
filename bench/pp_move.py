"""One move of ``parallel.pp_balance=dynamic`` (issue 55): the new split's state sent in
memory (``parallel.pp_balance_move=memory``) against written to and read back from a
checkpoint (``=checkpoint``), on the same processes.

A GPT wider and deeper than ``tiny`` (``--hidden``, ``--layers``) is trained one step on
pp2 (``--dp``, ``--tp`` widen the layout; ZeRO with ``--zero``), so AdamW holds its moments;
then its split goes back and forth between the even one and one with ``--shift`` layers
more on stage 0, ``--moves`` times per mode, the two modes alternating (the machine's load
drifts). A move is ``Trainer._resplit``, what the training loop calls at a step boundary:
take the state, build the new split's stages, give them the state. Its seconds are the
slowest rank's (a barrier before and after), medians over the moves; the state bytes are a
stage's (weights and moments) and the bytes that change stage in one move. Both modes build
the same stages, so the difference is the state's journey; ``build only`` is that building
alone (timed last), the floor of both. Prints each mode's median and spread, then
``ratio=<memory / checkpoint>`` last.

    .venv/bin/python bench/pp_move.py                       # hidden 512, 8 layers, pp2
    .venv/bin/python bench/pp_move.py --dp 2 --zero 3       # dp2 x pp2, ZeRO-3
    .venv/bin/python bench/pp_move.py --smoke               # the smallest run; figures mean nothing
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.testing import barrier_timed, spawn  # noqa: E402

MODES = ("memory", "checkpoint")


def job_overrides(args) -> list[str]:
    return ["model=tiny", f"model.layers={args.layers}", f"model.hidden={args.hidden}",
            f"model.heads={args.heads}", f"model.seq_len={args.seq}", "data=synthetic",
            "parallel=single", "parallel.pp=2", f"parallel.dp={args.dp}",
            f"parallel.tp={args.tp}", f"parallel.dp_strategy.zero.stage={args.zero}",
            "parallel.pp_balance=dynamic", "train.micro_batch=1",
            f"train.global_batch={2 * args.dp}", "train.timeline_step=0",
            "train.log_every=1000", "train.collective_timeout_s=600"]


def _moves(rank, world, overrides, tmp, moves, shift):
    from hybrid.groups import ParallelGroups
    from hybrid.planning.job import plan_job
    from hybrid.planning.stage_balance import layer_counts, split_of_counts
    from hybrid.train import Trainer
    from launch.commands.app import compose_train_config

    plan = plan_job(compose_train_config(overrides))
    trainer = Trainer(plan, ParallelGroups.create(plan.layout), Path(tmp) / "run")
    trainer.step(1)  # AdamW has state from here on
    even = layer_counts([stage.blocks for stage in plan.stages])
    shifted = [even[0] + shift, even[1] - shift]
    state_bytes = sum(p.numel() * 4 * 3 for _, p in trainer.checkpointer.params)
    moved = sum(p.numel() * 4 * 3 for s, p in trainer.checkpointer.params
                if s.name.startswith(tuple(f"blocks.{b}." for b in
                                           range(even[0] + 1, even[0] + shift + 1))))
    times = {mode: [] for mode in MODES}
    for move in range(2 * moves):
        mode = MODES[move % 2]
        split = shifted if move % 4 < 2 else even
        times[mode].append(barrier_timed(
            lambda: trainer._resplit(1, split_of_counts(split), mode)))
    times["build"] = [barrier_timed(lambda: _build_only(trainer)) for _ in range(moves)]
    return {"times": times, "state_bytes": state_bytes, "moved_bytes": moved}


def _build_only(trainer) -> None:
    """What both modes do besides moving the state: build the stages (their state is lost:
    run last)."""
    trainer.sync.close()
    trainer._build_stages(trainer.plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0, help="ZeRO stage (needs --dp 2+)")
    parser.add_argument("--shift", type=int, default=2, help="layers a move takes")
    parser.add_argument("--moves", type=int, default=4, help="moves per mode")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: tiny, 1 move")
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.heads, args.layers, args.seq, args.moves, args.shift = 32, 4, 4, 16, 1, 1
    # read by the fork server before it imports megatron-core, which warns on CPU machines
    os.environ.setdefault("PYTHONWARNINGS",
                          "ignore:Transformer Engine and Apex are not installed")
    ranks = 2 * args.dp * args.tp
    print(f"GPT hidden {args.hidden}, {args.layers} layers; dp {args.dp} x tp {args.tp} x pp 2, "
          f"zero {args.zero}; {ranks} ranks; {args.moves} moves per mode of {args.shift} "
          f"layers; load {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-pp-move-") as tmp:
        results = spawn(_moves, ranks, job_overrides(args), tmp, args.moves, args.shift,
                        timeout=3600)
    median = {}
    for mode in (*MODES, "build"):
        slowest = [max(r["times"][mode][i] for r in results) for i in range(args.moves)]
        median[mode] = statistics.median(slowest)
        what = "move" if mode in MODES else "only"
        print(f"{mode:>10}: median {what} {median[mode] * 1e3:8.1f} ms  (min "
              f"{min(slowest) * 1e3:.1f}, max {max(slowest) * 1e3:.1f})")
    state = max(r["state_bytes"] for r in results)
    moved = max(r["moved_bytes"] for r in results)
    print(f"state per rank {state / 2**20:.1f} MiB (weights + AdamW moments), of which a move "
          f"sends {moved / 2**20:.1f} MiB; load {os.getloadavg()[0]:.2f}")
    print(f"ratio={median['memory'] / median['checkpoint']:.3f} (memory / checkpoint move "
          f"seconds)")


if __name__ == "__main__":
    main()
