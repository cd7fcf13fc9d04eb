"""Even against dynamic DP shares with one replica throttled from outside (issue 40).

Trains the same dp2 job twice through ``hybrid-train``, ``parallel.dp_balance=even`` and
``=dynamic``, each with global rank 1's worker (DP replica 1) stopped and continued from outside
again and again (SIGSTOP ``--stop-ms``, SIGCONT ``--run-ms``: about half speed at 20/20,
``hybrid.testing.Throttle``). Prints each run's median step time over the steps after the
first two decision windows, its last shares and last loss; then the cost model's prediction
for replicas at the throttle's speeds (``cost.replica_speed=[1, run/(stop+run)]``,
``hybrid.planning.cost.replicas``); last ``ratio=<dynamic median / even median>``.

    .venv/bin/python bench/dp_balance.py [--steps 40] [--global-batch 24] [--out DIR]
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
from hybrid.planning.cost.replicas import replica_line, replica_prediction
from hybrid.planning.job import plan_job
from hybrid.testing import run_throttled

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
JOB = ["parallel=single", "parallel.dp=2", "data=synthetic", "train.micro_batch=2",
       "train.timeline_step=0", "train.log_every=1000", "train.collective_timeout_s=300",
       "optim.warmup_steps=0"]
THROTTLED_RANK = 1  # rank order tp-cp-dp-pp: rank 1 is DP replica 1


def run_mode(mode: str, args, out: Path) -> dict:
    run_dir = out / mode
    cmd = [TRAIN, *JOB, f"model={args.model}", f"train.global_batch={args.global_batch}",
           f"train.steps={args.steps}", f"parallel.dp_balance={mode}",
           f"parallel.dp_balance_every={args.every}", f"hydra.run.dir={run_dir}",
           "train.overwrite=true"]
    done = run_throttled(cmd, rank=THROTTLED_RANK, timeout=args.timeout,
                         stop_s=args.stop_ms / 1e3, run_s=args.run_ms / 1e3,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed: {done.stderr.strip().splitlines()[-1:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    settled = records[min(2 * args.every, len(records) - 1):]
    return {"mode": mode, "step_s": statistics.median(r["step_time_s"] for r in settled),
            "shares": records[-1].get("dp_shares", ["even"]), "loss": records[-1]["loss"],
            "cfg": from_dict(json.loads((run_dir / "config.json").read_text()))}


def predicted(cfg, speed: float) -> dict:
    cfg = replace(cfg, parallel=replace(cfg.parallel, dp_balance="even"))
    return replica_prediction(plan_job(cfg), device_for(cfg.cost), [1.0, speed])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=24,
                        help="micro-batches of 2: 24 gives 12, which a half-speed replica "
                             "splits 8/4")
    parser.add_argument("--every", type=int, default=5, help="parallel.dp_balance_every")
    parser.add_argument("--stop-ms", type=float, default=20.0)
    parser.add_argument("--run-ms", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--out", help="where the runs go (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the test "
                        "suite's): the tiny model, 6 steps; its figures mean nothing")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.steps, args.every, args.global_batch = "tiny", 6, 2, 8
    out = Path(args.out or tempfile.mkdtemp(prefix="dp-balance-"))
    rows = [run_mode(mode, args, out) for mode in ("even", "dynamic")]
    for row in rows:
        print(f"{row['mode']:<8} median step {row['step_s'] * 1e3:7.1f} ms  shares "
              f"{row['shares']}  last loss {row['loss']:.6f}")
    speed = args.run_ms / (args.stop_ms + args.run_ms)
    prediction = predicted(rows[0]["cfg"], speed)
    print(f"predicted: {replica_line(prediction)}")
    print(f"runs in {out}; throttle: rank {THROTTLED_RANK} stopped {args.stop_ms:g} ms, "
          f"running {args.run_ms:g} ms")
    print(f"ratio={rows[1]['step_s'] / rows[0]['step_s']:.3f} (predicted "
          f"{prediction['ratio']:.3f})")


if __name__ == "__main__":
    main()
