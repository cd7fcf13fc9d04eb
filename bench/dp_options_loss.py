"""What each lossy data-parallel option costs in loss, and what it saves in DP bytes.

    .venv/bin/python bench/dp_options_loss.py [--steps 120] [--out DIR]
    .venv/bin/python bench/dp_options_loss.py --smoke   # the smallest run (the test suite's)

The main job's model and training (``conf/base.yaml``: model ``small``, 120 steps, global
batch 16 in micro-batches of 2, AdamW with 10 warm-up steps, seed 1234) on ``parallel=single
parallel.dp=2``: 2 processes instead of the main job's DP 2 x TP 2 x PP 2, because ten
8-process runs do not fit in ~10 minutes on 2 cores; DP is what the options change. Each
option trains through the real ``hybrid-train`` (one intra-op thread per rank), one run
after another:

- exact (``dp_compress=none``), the baseline; ``zero=2``, exact too (its gap should be ~0);
- ``dp_compress=bf16``;
- ``dp_compress=powersgd`` at rank 1, 2 and 4, after ``powersgd_warmup=10`` exact steps (the
  learning-rate warm-up's length, as torch's docs advise for ``start_powerSGD_iter``);
- ``dp_sync_every`` 2, 4 and 8 (local SGD, parameters only: ``dp_sync_moments=false``);
- ``dp_delay=1``.

``--moe``: the same on ``model=moe-tiny`` (4 experts top-2, its aux loss on) at
``parallel.ep`` 1 and 2, for the exact mean and the options that keep their own state or
steps (PowerSGD rank 2, local SGD every 4, a delay of 1): each gap is to exact's at the same
``ep``, so the ep2 rows show whether the options lose more on expert weights, which at ep2 are
averaged over their expert group (one rank at dp 2; ``--dp 4``: two) instead of the whole DP
group.

Per option: the final loss (mean of the last 5 steps' losses, each the mean over DP), its gap
to exact's in percent (positive = worse), the DP bytes rank 0 sent per step (mean over all
steps, as ``CommCounter`` counted them in ``metrics.jsonl``) and the mean that
``hybrid.planning.job.rank_dp_bytes`` predicts for the run's resolved config (asserted equal), the
bytes' ratio to exact's, and ``yes`` where the gap is under 2% of exact's final loss (a
negative gap counts as under). Prints a markdown table, then ``ratio=<bytes per step of the
cheapest option under 2% / exact's>`` last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hybrid.planning.config import from_dict  # noqa: E402
from hybrid.planning.job import plan_job, rank_dp_bytes  # noqa: E402
from hybrid.metrics import read_metrics  # noqa: E402

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
JOB = ["parallel=single", "parallel.dp=2", "train.timeline_step=0", "train.log_every=1000",
       "launcher.omp_threads=1"]
POWERSGD = ["parallel.dp_compress=powersgd", "parallel.powersgd_warmup=10"]
OPTIONS = {
    "exact": [],
    "bf16": ["parallel.dp_compress=bf16"],
    "powersgd r1": [*POWERSGD, "parallel.powersgd_rank=1"],
    "powersgd r2": [*POWERSGD, "parallel.powersgd_rank=2"],
    "powersgd r4": [*POWERSGD, "parallel.powersgd_rank=4"],
    "sync every 2": ["parallel.dp_sync_every=2"],
    "sync every 4": ["parallel.dp_sync_every=4"],
    "sync every 8": ["parallel.dp_sync_every=8"],
    "delay 1": ["parallel.dp_delay=1"],
    "zero 2": ["parallel.zero=2"],
}
MOE = ["model=moe-tiny", "eval.every=0", "eval.at_end=false"]
MOE_OPTIONS = ["exact", "powersgd r2", "sync every 4", "delay 1"]
LAST = 5  # the final loss is the mean of this many last steps
GAP_LIMIT = 0.02


def train(name: str, overrides: list[str], steps: int, out: Path) -> dict:
    """One ``hybrid-train`` run: final loss, counted and predicted DP bytes per step."""
    run_dir = out / name.replace(" ", "_")
    started = time.monotonic()
    done = subprocess.run(
        [TRAIN, *JOB, *overrides, f"train.steps={steps}", f"hydra.run.dir={run_dir}",
         "train.overwrite=true"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        sys.exit(f"{name} failed:\n{done.stderr[-2000:]}")
    records = read_metrics(run_dir / "metrics.jsonl")
    cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    plan = plan_job(cfg, simulated=False)
    predicted = [rank_dp_bytes(cfg, plan, pp_rank=0, step=r["step"]) for r in records]
    counted = [r["comm_bytes"]["dp"] for r in records]
    if any(abs(c - p) > 1e-9 * max(p, 1.0) for c, p in zip(counted, predicted)):
        sys.exit(f"{name}: counted DP bytes {counted[:12]}... differ from the predicted "
                 f"{predicted[:12]}...")
    return {"name": name, "ep": cfg.parallel.ep,
            "loss": statistics.mean(r["loss"] for r in records[-LAST:]),
            "counted": statistics.mean(counted), "predicted": statistics.mean(predicted),
            "seconds": time.monotonic() - started}


def mark_gaps(rows: list[dict]) -> None:
    """Each row's gap to exact's final loss (the first row of its ``ep``), and whether it is
    under 2%."""
    exact = {}
    for row in rows:
        exact.setdefault(row["ep"], row)
        row["exact"] = exact[row["ep"]]
        row["gap"] = row["loss"] / row["exact"]["loss"] - 1
        row["under"] = row["gap"] < GAP_LIMIT


def table(rows: list[dict]) -> list[str]:
    lines = ["| option | ep | final loss | gap vs exact | DP bytes/step counted | predicted | "
             "bytes vs exact | gap < 2% |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for row in rows:
        exact = row["exact"]
        lines.append(f"| {row['name']} | {row['ep']} | {row['loss']:.4f} | {row['gap']:+.2%} | "
                     f"{row['counted'] / 2**20:.3f} MiB | {row['predicted'] / 2**20:.3f} MiB | "
                     f"{row['counted'] / exact['counted']:.3f} | "
                     f"{'yes' if row['under'] else 'no'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="the main job's 120 by default")
    parser.add_argument("--out", help="where the runs go (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the test "
                        "suite's): exact and bf16 only, 2 steps of the tiny model on "
                        "generated data; its figures mean nothing")
    parser.add_argument("--dp", type=int, default=2, help="DP replicas (2 by default)")
    parser.add_argument("--moe", action="store_true", help="moe-tiny at ep 1 and 2 (exact, "
                        "PowerSGD, local SGD, delayed)")
    args = parser.parse_args()
    if args.smoke:  # what the command line gave explicitly stays
        args = parser.parse_args(namespace=argparse.Namespace(steps=2))
    options = ["exact", "bf16"] if args.smoke else MOE_OPTIONS if args.moe else list(OPTIONS)
    job = ["model=tiny", "data=synthetic"] if args.smoke else MOE if args.moe else []
    out = Path(args.out or tempfile.mkdtemp(prefix="dp-options-loss-"))
    rows = []
    for ep in (1, 2) if args.moe else (1,):
        for name in options:
            expert = [f"parallel.ep={ep}"] if args.moe else []
            rows.append(train(f"{name} ep{ep}" if args.moe else name,
                              [*OPTIONS[name], *job, *expert, f"parallel.dp={args.dp}"],
                              args.steps, out))
            rows[-1]["name"] = name
            print(f"{name} ep{ep}: loss {rows[-1]['loss']:.4f}, {rows[-1]['counted'] / 2**20:.3f} "
                  f"MiB DP/step, {rows[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
    print(f"{' '.join(job) or 'model=small'} dp={args.dp} steps={args.steps}: final loss = "
          f"mean of "
          f"the last {LAST} steps; "
          f"bytes = mean per step that rank 0 sent over DP (counted = predicted, asserted); "
          f"runs in {out}")
    mark_gaps(rows)
    print("\n".join(table(rows)))
    cheapest = min((r for r in rows if r["under"]),
                   key=lambda r: r["counted"] / r["exact"]["counted"])
    print(f"cheapest under {GAP_LIMIT:.0%}: {cheapest['name']} (ep {cheapest['ep']})")
    print(f"ratio={cheapest['counted'] / cheapest['exact']['counted']:.4f}")


if __name__ == "__main__":
    main()
