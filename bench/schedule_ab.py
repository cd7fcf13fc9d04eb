"""Pipeline schedules against each other inside one job: what a schedule itself costs.

    .venv/bin/python bench/schedule_ab.py                      # pp2: 1f1b against zb-h1
    .venv/bin/python bench/schedule_ab.py --pp 4 --schedules gpipe 1f1b zb-h1
    .venv/bin/python bench/schedule_ab.py --smoke   # the smallest run (the test suite's)

Separate runs of one layout differ by 10-20% in CPU per step on a shared machine, more than
one schedule differs from another. Here one job (``train_overhead.py``'s model, the real
``Trainer``) builds its trainer once and alternates blocks of ``--steps`` steps between the
schedules (swapping the rank's action list; the first block of each warms up), so that the
machine's drift hits all of them alike. The schedules must place stages alike (all with
``--vpp 1``, or ``interleaved-1f1b`` alone with ``--vpp 2``): the ranks' chunks are built
once. Prints each schedule's CPU s/step summed over ranks
(median over its blocks' steps) and, last, ``ratio=<second / first>``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tp_floor import composed, cpu_trainer, job_words, train_overrides  # noqa: E402


def measure(cfg_dict: dict, run_dir: str, schedules: list[str], blocks: int,
            steps: int) -> dict[str, list[float]]:
    """One rank: CPU seconds of each measured step, by schedule."""
    import torch.distributed as dist

    from hybrid.planning.schedules import add_communication, build_schedule

    trainer = cpu_trainer(cfg_dict, run_dir)
    groups = trainer.groups
    layout = groups.layout
    actions = {}
    for name in schedules:
        lists = add_communication(build_schedule(name, layout.pp, trainer.m, vpp=layout.vpp),
                                  layout.pp, layout.vpp)
        actions[name] = lists[groups.pp_rank]
    cpu: dict[str, list[float]] = {name: [] for name in schedules}
    step = 0
    for block in range(blocks + 1):
        for name in (schedules if block % 2 else schedules[::-1]):
            trainer.actions = actions[name]
            for _ in range(steps):
                step += 1
                start = time.process_time()
                trainer.step(step)
                if block:  # block 0 warms every schedule up
                    cpu[name].append(time.process_time() - start)
    trainer.sync.close()
    dist.destroy_process_group()
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1"])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the test "
                        "suite's): one block of one step of a 2-layer tiny model, global batch "
                        "4; its figures mean nothing")
    args = parser.parse_args()
    if args.smoke:  # what the command line gave explicitly stays
        args = parser.parse_args(namespace=argparse.Namespace(blocks=1, steps=1))
    from launch.launchers.local import run_local

    if "zb-v" in args.schedules or (args.vpp > 1) != ("interleaved-1f1b" in args.schedules):
        parser.error("schedules of one placement: loop-placed with --vpp 1, or "
                     "interleaved-1f1b with --vpp 2 (zb-v places stages otherwise)")
    total = (args.blocks + 1) * len(args.schedules) * args.steps + 1
    schedule = args.schedules[0]  # what the layout is checked with; the blocks swap it
    cfg = composed([*train_overrides("small", total, args.smoke), "parallel=single",
                    f"parallel.pp={args.pp}", f"parallel.vpp={args.vpp}",
                    f"parallel.schedule={schedule}"])
    with tempfile.TemporaryDirectory() as run_dir:
        results = run_local(measure, (cfg, run_dir, args.schedules, args.blocks,
                                      args.steps),
                            nproc=args.pp, omp_threads=1, run_dir=run_dir)
    print(f"pp={args.pp} vpp={args.vpp}, {job_words(smoke=args.smoke)}; {args.blocks} blocks of "
          f"{args.steps} steps per schedule, alternating")
    sums = {}
    for name in args.schedules:
        per_rank = [statistics.median(r[name]) for r in results]
        sums[name] = sum(per_rank)
        print(f"{name:<18} CPU s/step {sums[name]:.3f} (per rank "
              f"{', '.join(f'{c:.3f}' for c in per_rank)})")
    first, second = args.schedules[:2] if len(args.schedules) > 1 else args.schedules * 2
    print(f"ratio={sums[second] / sums[first]:.3f}")


if __name__ == "__main__":
    main()
