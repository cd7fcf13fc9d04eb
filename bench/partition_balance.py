"""Stages split by layer count against stages split by measured block costs, on a GPT whose
last stage is heavy (a large vocabulary: the head's projection and loss outweigh several
layers). Trains the same job with ``parallel.partition=uniform`` and ``=measured`` through
``hybrid-train`` and prints, for each, the stages, the measured pipeline bubble (the ranks'
mean share of a step spent waiting on pipeline receives, ``rank_times.jsonl``, the median of
the steps after the first two), the bubble of the one step the timeline records
(``timeline_bubble.json``) and the median step time (``metrics.jsonl``). Prints
``ratio=<measured bubble / uniform bubble>`` last (below 1: the measured split idles less).

    .venv/bin/python bench/partition_balance.py [--pp 2] [--steps 8] [--out DIR]
    .venv/bin/python bench/partition_balance.py --smoke   # the smallest run (the test suite's)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from cost_vs_measured import read_run, train  # bench/ is on the path when a bench runs as a script

TIMELINE_STEP = 4
MODEL = ["parallel=single", "model=small", "model.layers=12", "model.vocab=16384",
         "train.global_batch=16", "train.micro_batch=2", "train.log_every=100",
         f"train.timeline_step={TIMELINE_STEP}", "optim.warmup_steps=0"]
SMOKE_JOB = ["model.layers=4", "model.vocab=2048", "train.global_batch=8",
             "data=synthetic"]  # --smoke: after MODEL, so these win


def run_partition(mode: str, pp: int, steps: int, out: Path, job: list[str]) -> dict:
    run_dir = out / mode
    train(run_dir, [*MODEL, *job, f"parallel.pp={pp}", f"parallel.partition={mode}",
                    f"train.steps={steps}"])
    records, _, cfg = read_run(run_dir)
    bubble = json.loads((run_dir / "timeline_bubble.json").read_text())
    if mode == "measured":  # the ranks measured these; config.json was written before
        cfg.parallel.block_costs = json.loads((run_dir / "block_costs.json").read_text())[
            "cost_s"]
    return {"mode": mode, "bubble": pipeline_wait_share(run_dir), "timeline": bubble["measured"],
            "bubble_per_rank": bubble["measured_per_rank"],
            "step_s": statistics.median(r["step_time_s"] for r in records[2:]),
            "loss": records[-1]["loss"], "cfg": cfg}


def pipeline_wait_share(run_dir: Path) -> float:
    """The bubble over every step after the first two: per step, the ranks' mean share of
    the step spent waiting on pipeline receives (``rank_times.jsonl``); the median step.
    Steadier on a shared machine than the one step the timeline records."""
    shares = []
    for line in (run_dir / "rank_times.jsonl").read_text().splitlines()[2:]:
        r = json.loads(line)
        totals = [c + sum(w[i] for w in r["wait_s"].values()) for i, c in
                  enumerate(r["compute_s"])]
        shares.append(statistics.mean(p / t for p, t in zip(r["wait_s"]["pp"], totals)))
    return statistics.median(shares)


def layers_per_stage(cfg) -> list[int]:
    from hybrid.planning.job import plan_job

    last = cfg.model.layers + 1
    return [sum(1 for b in st.blocks if 0 < b < last) for st in plan_job(cfg).stages]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", help="where the runs go (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the test "
                        "suite's): 4 layers, a 2048 vocabulary, batch 8, generated data, "
                        "4 steps; its figures mean nothing")
    args = parser.parse_args()
    if args.smoke:  # what the command line gave explicitly stays
        args = parser.parse_args(namespace=argparse.Namespace(steps=TIMELINE_STEP))
    job = SMOKE_JOB if args.smoke else []
    if args.steps < TIMELINE_STEP:
        parser.error(f"--steps must reach the timeline step {TIMELINE_STEP}")
    out = Path(args.out or tempfile.mkdtemp(prefix="partition-balance-"))
    rows = [run_partition(mode, args.pp, args.steps, out, job)
            for mode in ("uniform", "measured")]
    costs = json.loads((out / "measured" / "block_costs.json").read_text())["cost_s"]
    print(f"pp={args.pp}; {' '.join([*MODEL, *job])}")
    print(f"measured F+B ms: embedding {costs[0] * 1e3:.2f}, layer {costs[1] * 1e3:.2f}, "
          f"head {costs[-1] * 1e3:.2f}")
    print(f"{'partition':>9} {'layers per stage':>16} {'bubble':>7} {'timeline':>8} "
          f"{'timeline per rank':>17} {'step s':>7} {'last loss':>9}")
    for r in rows:
        per_rank = " ".join(f"{b:.2f}" for b in r["bubble_per_rank"])
        print(f"{r['mode']:>9} {str(layers_per_stage(r['cfg'])):>16} {r['bubble']:>7.3f} "
              f"{r['timeline']:>8.3f} {per_rank:>17} {r['step_s']:>7.3f} {r['loss']:>9.4f}")
    uniform, measured = rows
    print(f"step time measured/uniform: {measured['step_s'] / uniform['step_s']:.3f}")
    print(f"ratio={measured['bubble'] / uniform['bubble']:.3f}")


if __name__ == "__main__":
    main()
