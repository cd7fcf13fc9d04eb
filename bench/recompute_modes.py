"""What each ``model.recompute`` mode costs and saves, measured: step time and the activation
peak of the busiest rank (saved-tensor hooks, from each run's ``memory_check.json``), for
none, selective and full, on one layout, side by side, with the cost model's prediction of
both. Prints ``ratio=<full step time / none>`` last (the price of full recompute here).

    .venv/bin/python bench/recompute_modes.py [--steps 8] [--layout parallel.tp=2 ...]
    .venv/bin/python bench/recompute_modes.py --smoke   # the smallest run (the test suite's)

On this project's CPUs attention is a fused kernel that keeps no score matrix, so selective
recompute saves only a log-sum-exp per head and token; full recompute keeps only each layer's
input (plus, not measured by the hooks, one layer's activations while it is recomputed).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from cost_vs_measured import read_run, train  # bench/ is on the path when a bench runs as a script
from hybrid.planning.cost.devices import load_device
from hybrid.planning.job import plan_job
from hybrid.planning.cost.steptime import predict_step

MODEL = ["model=small", "model.layers=8", "model.hidden=256", "model.heads=8",
         "model.seq_len=256", "train.global_batch=16", "train.micro_batch=4",
         "train.log_every=100", "train.timeline_step=0", "optim.warmup_steps=0"]
SMOKE_JOB = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=32",
             "train.global_batch=4", "data=synthetic"]  # --smoke: after MODEL, so these win
MODES = ("none", "selective", "full")


def run_mode(mode: str, layout: list[str], steps: int, out: Path) -> dict:
    train(out / mode, [*MODEL, *layout, f"model.recompute={mode}", f"train.steps={steps}"])
    records, ranks, cfg = read_run(out / mode)
    return {"mode": mode, "step_s": statistics.median(r["step_time_s"] for r in records[1:]),
            "loss": records[-1]["loss"],
            "act_bytes": max(r["activation_peak_bytes"] for r in ranks),
            "predicted_act_bytes": max(r["predicted_activation_bytes"] for r in ranks),
            "predicted_step_s": predict_step(plan_job(cfg), load_device(cfg.cost.device))
            .step_time_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layout", nargs="*", default=["parallel=single", "parallel.tp=2"])
    parser.add_argument("--out", help="where the runs go (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the test "
                        "suite's): none and full only, 2 steps of a 2-layer GPT on generated "
                        "data in 1 process; its figures mean nothing")
    args = parser.parse_args()
    if args.smoke:  # what the command line gave explicitly stays; the job's overrides follow
        args = parser.parse_args(namespace=argparse.Namespace(steps=2, layout=["parallel=single"]))
        args.layout = [*args.layout, *SMOKE_JOB]
    out = Path(args.out or tempfile.mkdtemp(prefix="recompute-modes-"))
    modes = ("none", "full") if args.smoke else MODES
    rows = [run_mode(mode, args.layout, args.steps, out) for mode in modes]
    none = rows[0]
    print(f"layout: {' '.join(args.layout)}; {' '.join(MODEL)}")
    print(f"{'recompute':>9} {'step s':>7} {'vs none':>7} {'act MiB':>8} {'vs none':>7} "
          f"{'predicted act MiB':>17} {'last loss':>9}")
    for r in rows:
        print(f"{r['mode']:>9} {r['step_s']:>7.3f} {r['step_s'] / none['step_s']:>7.2f} "
              f"{r['act_bytes'] / 2**20:>8.2f} {r['act_bytes'] / none['act_bytes']:>7.2f} "
              f"{r['predicted_act_bytes'] / 2**20:>17.2f} {r['loss']:>9.4f}")
    assert len({round(r["loss"], 4) for r in rows}) == 1, "recompute changed the losses"
    print(f"ratio={rows[-1]['step_s'] / none['step_s']:.3f}")


if __name__ == "__main__":
    main()
