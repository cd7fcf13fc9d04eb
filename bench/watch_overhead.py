"""What hang and straggler diagnosis costs: the main job's step time with and without it.

    .venv/bin/python bench/watch_overhead.py [--blocks 10] [--steps 4]
    .venv/bin/python bench/watch_overhead.py --smoke   # the smallest run: 2 ranks, tiny model

One 8-rank job (the main job: small GPT, DP 2 x TP 2 x PP 2, 1F1B) builds one ``Trainer`` and
alternates blocks of ``--steps`` steps with diagnosis on and off (``Trainer.set_watching``):
on, every collective is described as it is issued and its wait timed per axis (synchronous
ones where they are issued, the DP buckets where the gradient sync waits), and every action
reports its start and end. Both modes run the same per-step all-gather of the
per-rank times, so the difference is the hooks alone. Alternating blocks in one job keeps the
machine's drift out of the comparison. Prints the median step time (the slowest rank's wall
time) and CPU seconds summed over ranks for each mode, the operations hooked per step, the
spread of the on/off ratio over the pairs of adjacent blocks (the noise of this machine), and
``ratio=<on/off>`` of the median step times last (the issue asks for under 1.02).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tp_floor import composed, cpu_trainer  # noqa: E402


def measure(cfg_dict: dict, run_dir: str, blocks: int, steps: int) -> dict:
    """One rank: alternate watched and unwatched blocks; rank 0's step reports are returned."""
    import torch.distributed as dist

    trainer = cpu_trainer(cfg_dict, run_dir)
    pairs: list[dict[str, list]] = []
    calls = []
    step = 0
    for block in range(blocks + 1):
        pair: dict[str, list] = {}
        for mode in (("on", "off") if block % 2 else ("off", "on")):
            trainer.set_watching(mode == "on")
            pair[mode] = []
            for _ in range(steps):
                step += 1
                report = trainer.step(step)
                pair[mode].append((report.step_time_s, report.cpu_s))
                calls.append(sum(c["calls"] for c in report.comm.values()))
        if block:  # block 0 warms up both modes
            pairs.append(pair)
    trainer.sync.close()
    dist.destroy_process_group()
    return {"pairs": pairs, "calls": statistics.median(calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the test "
                        "suite's): one block of one step, tiny model, DP 2 on 2 ranks")
    args = parser.parse_args()
    job, nproc, name = [], 8, "main job (model=small, 2x2x2 1f1b)"
    if args.smoke:  # what the command line gave explicitly stays
        args = parser.parse_args(namespace=argparse.Namespace(blocks=1, steps=1))
        job, nproc = ["model=tiny", "parallel=single", "parallel.dp=2"], 2
        name = "model=tiny, dp2"

    from launch.launchers.local import run_local

    total = 2 * (args.blocks + 1) * args.steps
    # Generated data: these workers build their Trainer without the indexed data that
    # hybrid-train builds before its workers start (the main job's default).
    cfg = composed([*job, f"train.steps={total}", "train.timeline_step=0", "data=synthetic"])
    with tempfile.TemporaryDirectory() as run_dir:
        results = run_local(measure, (cfg, run_dir, args.blocks, args.steps),
                            nproc=nproc, omp_threads=1, run_dir=run_dir)
    pairs, calls = results[0]["pairs"], results[0]["calls"]
    print(f"{name}, {args.blocks} pairs of blocks of {args.steps} "
          f"steps, alternating; {calls:.0f} operations hooked per step on rank 0")
    wall = {}
    for mode in ("off", "on"):
        wall[mode] = statistics.median(t for pair in pairs for t, _ in pair[mode])
        cpu = statistics.median(c for pair in pairs for _, c in pair[mode])
        print(f"diagnosis {mode:<3}  median step {wall[mode] * 1000:8.1f} ms   "
              f"CPU {cpu:7.3f} s/step ({nproc} ranks)")
    # Adjacent blocks share the machine's state: their ratio is the paired comparison.
    ratios = sorted(statistics.median(t for t, _ in pair["on"])
                    / statistics.median(t for t, _ in pair["off"]) for pair in pairs)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    print(f"noise: on/off per pair of adjacent blocks: min {ratios[0]:.3f}  quartiles "
          f"{quartiles[0]:.3f} {quartiles[1]:.3f} {quartiles[2]:.3f}  max {ratios[-1]:.3f}")
    print(f"ratio={wall['on'] / wall['off']:.3f}")

if __name__ == "__main__":
    main()
