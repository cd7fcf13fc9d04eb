"""The cost of parallelism: CPU-seconds per training step of each layout / the 1-process run's.

    .venv/bin/python bench/train_overhead.py [--model small] [--steps 8] [--skip 3]
    .venv/bin/python bench/train_overhead.py --layouts "1 process" "pp2 zb-h1" --rounds 3
    .venv/bin/python bench/train_overhead.py --smoke   # the smallest run (the test suite's)

Every layout trains the same model on the same global batch through the real ``hybrid-train``
(so workers, groups, schedule, gradient sync and metrics are all included). ``cpu_s`` in
``metrics.jsonl`` is a step's CPU time summed over all ranks; the table shows its median over
the steps after ``--skip`` warm-up steps, and the ratio to the 1-process run (1.0 = free
parallelism; above 1 is the overhead paid in communication, bubbles and duplicated work such
as TP-replicated norms). Every rank runs one intra-op thread (``launcher.omp_threads=1``),
the 1-process run included, so the ratio compares the same kind of work. Wall time per step is
printed too, but on a 2-core machine 8 ranks mostly wait for cores, so CPU time is the fair
measure there.

For each layout with TP, ``floor`` is what that layout's step cannot cost less than
(``bench/tp_floor.py``, run on the same model and batch): the step with its TP collectives
answered without communicating (the sharded and replicated work every TP rank must do) plus
those collectives replayed alone. ``/floor`` is the layout's CPU s/step over its floor; the last
line is ``ratio=<tp2 CPU s/step / tp2 floor>`` when tp2 runs (``--no-floor`` skips the floors).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hybrid.metrics import read_metrics  # noqa: E402
from tp_floor import job_words, run_floor, train_overrides  # noqa: E402

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
LAYOUTS = {
    "1 process": ["parallel=single"],
    "dp2": ["parallel=single", "parallel.dp=2"],
    "tp2": ["parallel=single", "parallel.tp=2"],
    "pp2 1f1b": ["parallel=single", "parallel.pp=2"],
    "2x2x2 1f1b": [],
    "pp4 interleaved vpp2": ["parallel=single", "parallel.pp=4", "parallel.vpp=2",
                             "parallel.schedule=interleaved-1f1b"],
    "pp2 zb-h1": ["parallel=single", "parallel.pp=2", "parallel.schedule=zb-h1"],
    "2x2x2 zero1": ["parallel.zero=1"],
}


def run(name: str, overrides: list[str], args: argparse.Namespace) -> tuple[int, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [TRAIN, *train_overrides(args.model, args.steps, args.smoke), f"hydra.run.dir={tmp}",
               *overrides]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{name} failed:\n{done.stderr[-2000:]}")
        records = read_metrics(Path(tmp) / "metrics.jsonl")[args.skip:]
        par = json.loads((Path(tmp) / "config.json").read_text())["parallel"]
    return (par["dp"] * par["tp"] * par["pp"],
            statistics.median(r["cpu_s"] for r in records),
            statistics.median(r["step_time_s"] for r in records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                        metavar="NAME", help="run only these rows (the first is the ratio's "
                        "base); default: all of " + ", ".join(map(repr, LAYOUTS)))
    parser.add_argument("--no-floor", action="store_true", help="skip the TP layouts' floors")
    parser.add_argument("--rounds", type=int, default=1, help="run every layout this many "
                        "times, round-robin, and show the medians")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the test "
                        "suite's): tp2 alone, 2 steps of a 2-layer tiny model, global batch 4, "
                        "and a floor of one step per mode; its figures mean nothing")
    args = parser.parse_args()
    if args.smoke:  # what the command line gave explicitly stays
        args = parser.parse_args(namespace=argparse.Namespace(steps=2, skip=1, layouts=["tp2"]))
    floor_size = {"blocks": 1, "steps": 1} if args.smoke else {"blocks": 2, "steps": 3}
    print(f"{job_words(args.model, args.smoke)}, median over steps {args.skip + 1}.."
          f"{args.steps} (and over {args.rounds} round-robin runs of each layout)")
    print(f"{'layout':<22} {'ranks':>5} {'CPU s/step':>11} {'wall s/step':>12} "
          f"{'CPU ratio':>10} {'floor':>7} {'/floor':>7}")
    base, ratio = None, None
    # Round-robin: a slow minute of the shared machine then hits every layout alike, and the
    # median over rounds drops it (one run of a layout moves by 10-20% on its own).
    samples: dict[str, list] = {name: [] for name in args.layouts}
    for _ in range(args.rounds):
        for name in args.layouts:
            samples[name].append(run(name, LAYOUTS[name], args))
    for name in args.layouts:
        ranks = samples[name][0][0]
        cpu, wall = (statistics.median(s[i] for s in samples[name]) for i in (1, 2))
        base = base or cpu
        floor = None
        if not args.no_floor and has_tp(LAYOUTS[name]):
            floor = run_floor(train_overrides(args.model, args.steps, args.smoke)
                              + LAYOUTS[name], **floor_size)["floor"]
        extra = f" {floor:>7.3f} {cpu / floor:>7.2f}" if floor else ""
        print(f"{name:<22} {ranks:>5} {cpu:>11.3f} {wall:>12.3f} {cpu / base:>10.2f}{extra}",
              flush=True)
        if name == "tp2" and floor:
            ratio = cpu / floor
    if ratio is not None:
        print(f"ratio={ratio:.3f}")


def has_tp(overrides: list[str]) -> bool:
    """Whether the layout has TP > 1 (the main job's default layout, 2x2x2, has)."""
    return "parallel=single" not in overrides or "parallel.tp=2" in overrides


if __name__ == "__main__":
    main()
