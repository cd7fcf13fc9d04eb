"""Even against dynamic DP shares with one replica throttled from outside (issue 40).

For each layout (dp2; dp2 x pp2 under 1F1B; dp4 under ZeRO-2) trains the same job through
``hybrid-train`` with ``parallel.dp_balance=even`` and ``=dynamic``, alternating (``--rounds``
pairs: the machine's load drifts, and alternating shares it out between the two), each run
with global rank 1's worker (DP replica 1; pipeline stage 0 under pp2) stopped and continued
from outside again and again (SIGSTOP ``--stop-ms``, SIGCONT ``--run-ms``, by default the
layout's, ``LAYOUTS``; ``hybrid.testing.throttle.Throttle``): the same throttling for both. Prints
each run's median step time over the steps after the first two decision windows, its last
shares, last loss and the load; then per layout the median over each mode's runs, the cost model's prediction
(``hybrid.planning.cost.replicas``) for replicas at the speeds the even runs measured (each
replica's slowest rank's median compute, against the fastest replica's), how busy each mode
kept the cores and the floor they put on the ratio (``cores_busy``), and last
``ratio=<dynamic median / even median>``.

    .venv/bin/python bench/dp_balance.py [--layouts dp2,dp2xpp2-1f1b,dp4-zero2] [--rounds 2]
    .venv/bin/python bench/dp_balance.py --smoke   # the smallest run (the test suite's)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from hybrid.planning.config import from_dict
from hybrid.planning.cost.devices import device_for
from hybrid.planning.cost.replicas import measured_speeds as cost_speeds
from hybrid.planning.cost.replicas import replica_prediction
from hybrid.planning.job import plan_job
from hybrid.testing.throttle import run_throttled

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
JOB = ["parallel=single", "data=synthetic", "train.micro_batch=2", "train.timeline_step=0",
       "train.log_every=1000", "train.collective_timeout_s=300", "optim.warmup_steps=0"]
LAYOUTS = {  # name: (overrides, global batch in micro-batches of 2, throttle stop/run ms)
    "dp2": (["parallel.dp=2"], 24, (20.0, 20.0)),  # 12: 8/4 at half speed
    "dp2xpp2-1f1b": (["parallel.dp=2", "parallel.pp=2", "parallel.schedule=1f1b"], 24,
                     (30.0, 10.0)),
    "dp4-zero2": (["parallel.dp=4", "parallel.zero=2"], 32, (30.0, 10.0)),  # 16
}
"""With 4 workers on this machine's 2 cores, the cores a stopped worker leaves go to its
peers, and 20/20 ms left the throttled replica at 0.7-0.77 of their speed, not half (bench
runs of 2026-12-03): 30/10 brings it nearer half. The speeds the even runs measured are
printed, and the prediction is made at them."""
THROTTLED_RANK = 1  # rank order tp-cp-dp-pp: rank 1 is DP replica 1 (pipeline stage 0)


def run_mode(layout: str, mode: str, args, run_dir: Path) -> dict:
    overrides, global_batch, (stop_ms, run_ms) = LAYOUTS[layout]
    stop_ms, run_ms = args.stop_ms or stop_ms, args.run_ms or run_ms
    cmd = [TRAIN, *JOB, *overrides, f"model={args.model}",
           f"train.global_batch={args.global_batch or global_batch}",
           f"train.steps={args.steps}", f"parallel.dp_balance={mode}",
           f"parallel.dp_balance_every={args.every}", f"hydra.run.dir={run_dir}",
           "train.overwrite=true"]
    done = run_throttled(cmd, rank=THROTTLED_RANK, timeout=args.timeout,
                         stop_s=stop_ms / 1e3, run_s=run_ms / 1e3,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{layout} {mode} failed: {done.stderr.strip().splitlines()[-1:]}")
    records = read_lines(run_dir / "metrics.jsonl")
    settled = slice(min(2 * args.every, len(records) - 1), None)
    return {"mode": mode, "step_s": [r["step_time_s"] for r in records[settled]],
            "cpu_s": [r["cpu_s"] for r in records[settled]],
            "shares": records[-1].get("dp_shares", ["even"]), "loss": records[-1]["loss"],
            "speeds": measured_speeds(run_dir, settled),
            "cfg": from_dict(json.loads((run_dir / "config.json").read_text()))}


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def measured_speeds(run_dir: Path, settled: slice) -> list[float]:
    """Each replica's speed against the fastest (``cost.replicas.measured_speeds``)."""
    cfg = json.loads((run_dir / "config.json").read_text())["parallel"]
    dp, tp, cp = cfg["dp"], cfg.get("tp", 1), cfg.get("cp", 1)
    lines = read_lines(run_dir / "rank_times.jsonl")[settled]
    dp_of_rank = [(rank // (tp * cp)) % dp for rank in range(len(lines[0]["compute_s"]))]
    return cost_speeds([line["compute_s"] for line in lines], dp_of_rank, dp)


def predicted(cfg, speeds: list[float]) -> dict:
    cfg = replace(cfg, parallel=replace(cfg.parallel, dp_balance="even"))
    return replica_prediction(plan_job(cfg), device_for(cfg.cost), speeds)


def bench_layout(layout: str, args, out: Path) -> str:
    """``args.rounds`` rounds of an even run then a dynamic one: the machine's load drifts,
    and alternating shares it out between the two modes."""
    runs: dict[str, list[dict]] = {"even": [], "dynamic": []}
    for round_ in range(args.rounds):
        for mode in runs:
            row = run_mode(layout, mode, args, out / layout / f"{mode}-{round_}")
            runs[mode].append(row)
            step_ms = statistics.median(row["step_s"]) * 1e3
            print(f"{layout:<13} {mode:<8} median step {step_ms:7.1f} ms  shares "
                  f"{row['shares']}  last loss {row['loss']:.6f}  load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    median = {mode: statistics.median(t for row in rows for t in row["step_s"])
              for mode, rows in runs.items()}
    speeds = [round(statistics.median(s), 3)
              for s in zip(*(row["speeds"] for row in runs["even"]))]
    p = predicted(runs["even"][0]["cfg"], speeds)
    busy, floor = cores_busy(runs, median)
    return (f"{layout}: median step even {median['even'] * 1e3:.1f} ms, dynamic "
            f"{median['dynamic'] * 1e3:.1f} ms; replica speeds measured {speeds}; predicted "
            f"{p['ratio']:.3f} (balanced {p['balanced_shares']}); cores busy even "
            f"{busy['even']:.2f}, dynamic {busy['dynamic']:.2f}; cpu floor {floor:.3f}; "
            f"ratio={median['dynamic'] / median['even']:.3f}")


def cores_busy(runs: dict, median: dict) -> tuple[dict, float]:
    """How busy each mode kept this machine's cores (the workers' CPU a step, summed over
    ranks, over cores x step time), and the floor on the ratio where the cores are what
    limits: dynamic's CPU a step spread over every core, against even's step. When workers
    outnumber cores, balancing can only fill the cores an even step leaves idle."""
    cores = len(os.sched_getaffinity(0))
    cpu = {mode: statistics.median(c for row in rows for c in row["cpu_s"])
           for mode, rows in runs.items()}
    busy = {mode: cpu[mode] / (cores * median[mode]) for mode in runs}
    return busy, cpu["dynamic"] / cores / median["even"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="default: the layout's (a half-speed replica's share whole)")
    parser.add_argument("--every", type=int, default=3, help="parallel.dp_balance_every")
    parser.add_argument("--rounds", type=int, default=2, help="even-then-dynamic pairs")
    parser.add_argument("--stop-ms", type=float, help="default: the layout's (LAYOUTS)")
    parser.add_argument("--run-ms", type=float, help="default: the layout's (LAYOUTS)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--out", help="where the runs go (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the test "
                        "suite's): dp2, the tiny model, 6 steps; its figures mean nothing")
    args = parser.parse_args()
    if args.smoke:
        args.layouts, args.model, args.steps, args.every, args.global_batch, args.rounds = \
            "dp2", "tiny", 6, 2, 8, 1
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="dp-balance-"))
    throttles = {n: (args.stop_ms or LAYOUTS[n][2][0], args.run_ms or LAYOUTS[n][2][1])
                 for n in layouts}  # as run_mode takes them
    print(f"runs in {out}; throttle: rank {THROTTLED_RANK} stopped/running "
          f"{', '.join(f'{n} {stop:g}/{run:g} ms' for n, (stop, run) in throttles.items())}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    results = [bench_layout(layout, args, out) for layout in layouts]
    print(f"load {os.getloadavg()[0]:.2f} at the end")
    for line in results:
        print(line)


if __name__ == "__main__":
    main()
