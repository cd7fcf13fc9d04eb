"""The cost model against this machine: calibrate, train many layouts, compare.

In each of ``--rounds`` rounds: runs ``hybrid-plan calibrate`` (or takes ``--device FILE``),
then trains each layout below (world <= 8) of a CPU-sized GPT with ``hybrid-train`` for a few
steps (every other round in reverse order) and predicts it on that round's calibration. None
of the layouts is a calibration figure: calibrate times single layers, collectives and stacks
of layers of other shapes. Per layout: the predicted step time against the measured one
(median of the steps after the first; with several rounds, the median over the rounds of
both), the predicted weight + gradient + optimizer bytes against those counted on the ranks,
and the predicted activation bytes against the peak measured by saved-tensor hooks (both from
each run's ``memory_check.json``, the largest rank). Prints a table, Spearman's rank
correlation and the mean absolute percentage error of each, how well the rounds' measured
times rank alike (the machine's own noise floor for the model's rank correlation), and
``ratio=<step-time error / 15%>`` last (the issue's targets: rho >= 0.9, error <= 15%).

A calibration is paired with the round it precedes because this shared machine's speed moves
by 10-20% over minutes (the same layout measured twice, or calibrated twice, differs by that):
the bench measures the model, not how far the machine has drifted since calibrating. Three
rounds by default (about 22 minutes): the median of three outvotes one round's outlier, a
layout measured in a slow minute or a calibration timed in one (two rounds' median is their
mean, and carries half of either).

    .venv/bin/python bench/cost_vs_measured.py [--device FILE] [--steps 10] [--rounds 3] [--out DIR]
    .venv/bin/python bench/cost_vs_measured.py --out DIR --predict-again   # after a model change
    .venv/bin/python bench/cost_vs_measured.py --smoke   # the smallest run (the test suite's)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hybrid.planning.config import from_dict
from hybrid.planning.cost.devices import load_device
from hybrid.planning.job import plan_job
from hybrid.planning.cost.steptime import predict_step
from launch.reports.sweep_report import spearman

BIN = Path(sys.executable).parent
MODEL = ["parallel=single", "model=small", "model.layers=8", "model.hidden=256", "model.heads=8",
         "model.seq_len=128", "train.global_batch=16", "train.log_every=100",
         "train.timeline_step=0", "optim.warmup_steps=0"]
SMOKE_JOB = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=32",
             "train.global_batch=8", "data=synthetic"]  # --smoke: after MODEL, so these win
LAYOUTS = {
    "1 mb2": ["train.micro_batch=2"],
    "1 mb8": ["train.micro_batch=8"],
    "dp2": ["parallel.dp=2"],
    "dp4": ["parallel.dp=4"],
    "dp8": ["parallel.dp=8"],
    "tp2": ["parallel.tp=2"],
    "tp2 sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp4": ["parallel.tp=4"],
    "pp2 1f1b": ["parallel.pp=2"],
    "pp2 gpipe mb4": ["parallel.pp=2", "parallel.schedule=gpipe", "train.micro_batch=4"],
    "pp2 zb-h1": ["parallel.pp=2", "parallel.schedule=zb-h1"],
    "pp4 interleaved": ["parallel.pp=4", "parallel.vpp=2", "parallel.schedule=interleaved-1f1b"],
    "dp2 tp2": ["parallel.dp=2", "parallel.tp=2"],
    "dp2 pp2 zero1": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=1"],
    "tp2 pp2": ["parallel.tp=2", "parallel.pp=2"],
    "2x2x2": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2"],
}


def train(run_dir: Path, overrides: list[str]) -> None:
    """One ``hybrid-train`` run (one thread per rank) into ``run_dir``."""
    done = subprocess.run(
        [str(BIN / "hybrid-train"), *overrides, f"hydra.run.dir={run_dir}",
         "train.overwrite=true"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)} failed: "
                         f"{done.stderr.strip().splitlines()[-1:]}")


def read_run(run_dir: Path) -> tuple[list[dict], list[dict], object]:
    """A run's metrics records, the ranks of its ``memory_check.json`` and its config."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ranks = json.loads((run_dir / "memory_check.json").read_text())["ranks"]
    return records, ranks, from_dict(json.loads((run_dir / "config.json").read_text()))


def run_layout(name: str, overrides: list[str], device: str, steps: int, out: Path,
               rerun: bool = True) -> dict:
    """Train a layout (unless ``rerun`` is False: its run in ``out`` is read again) and
    predict it on ``device`` with the cost model as it is now."""
    run_dir = out / name.replace(" ", "_")
    if rerun:
        train(run_dir, [*MODEL, *overrides, f"train.steps={steps}", f"cost.device={device}"])
    records, check, cfg = read_run(run_dir)
    predicted = predict_step(plan_job(cfg), load_device(device))
    return {
        "name": name,
        "measured_s": statistics.median(r["step_time_s"] for r in records[1:]),
        "predicted_s": predicted.step_time_s,
        "state_counted": max(sum(r["counted"].values()) for r in check),
        "state_predicted": max(sum(r["predicted"].values()) for r in check),
        "act_measured": max(r["activation_peak_bytes"] for r in check),
        "act_predicted": max(r["predicted_activation_bytes"] for r in check),
    }


def summary(rows: list[dict], predicted: str, measured: str) -> tuple[float, float]:
    """(Spearman rho, mean absolute percentage error) of one predicted/measured pair."""
    xs, ys = [r[predicted] for r in rows], [r[measured] for r in rows]
    mape = statistics.mean(abs(x - y) / y for x, y in zip(xs, ys))
    return spearman(xs, ys), mape


def rho_text(rho) -> str:
    """Spearman's rho, or n/a where it has none (under 3 layouts, or all figures equal)."""
    return "n/a" if rho is None else f"{rho:.3f}"


def one_round(index: int, args, out: Path) -> dict[str, dict]:
    """Calibrate (unless ``--device``), then run and predict every layout (with
    ``--predict-again``: predict the runs and calibrations kept in ``out``)."""
    device = args.device
    if device is None:
        device = str(out / f"device-{index}.json")
    if args.predict_again:
        return {name: run_layout(name, [*LAYOUTS[name], *args.job], device, args.steps,
                                 out / f"round-{index}", rerun=False) for name in args.layouts}
    if args.device is None:
        subprocess.run([str(BIN / "hybrid-plan"), "calibrate", "--out", device, "--seconds", "1"],
                       check=True)
    names = args.layouts if index % 2 == 0 else args.layouts[::-1]
    rows = {}
    for name in names:
        rows[name] = run_layout(name, [*LAYOUTS[name], *args.job], device, args.steps,
                                out / f"round-{index}")
        r = rows[name]
        print(f"round {index + 1} {name:<17} {r['measured_s']:>7.3f} {r['predicted_s']:>7.3f} "
              f"{r['predicted_s'] / r['measured_s'] - 1:>+6.0%}", flush=True)
    return rows


def combined(rounds: list[dict[str, dict]]) -> list[dict]:
    """Per layout, the median over the rounds of each figure."""
    return [{"name": name, **{key: statistics.median(r[name][key] for r in rounds)
                              for key in rounds[0][name] if key != "name"}}
            for name in rounds[0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", help="a calibrated device file (default: calibrate now)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="where the runs go (default: a temporary directory)")
    parser.add_argument("--predict-again", action="store_true",
                        help="train nothing: predict the runs --out kept, on their rounds' "
                             "calibrations, with the cost model as it is now")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run (the test suite's): one round of 2 steps of "
                             "two 1-process layouts of a 2-layer GPT on generated data, "
                             "predicted on the cpu preset (unless --device); its figures mean "
                             "nothing")
    args = parser.parse_args()
    args.layouts, args.job = list(LAYOUTS), []
    if args.smoke:  # what the command line gave explicitly stays
        args = parser.parse_args(namespace=argparse.Namespace(
            rounds=1, steps=2, device="cpu", layouts=["1 mb2", "1 mb8"], job=SMOKE_JOB))
    if args.predict_again and not args.out:
        parser.error("--predict-again needs --out DIR, a directory an earlier run filled")
    out = Path(args.out or tempfile.mkdtemp(prefix="cost-vs-measured-"))
    rounds = [one_round(i, args, out) for i in range(args.rounds)]
    rows = combined(rounds)
    print(f"{'layout':<17} {'step s':>7} {'pred s':>7} {'err':>6}  {'state MiB':>9} "
          f"{'pred':>7}  {'act MiB':>7} {'pred':>7}", flush=True)
    for r in rows:
        print(f"{r['name']:<17} {r['measured_s']:>7.3f} {r['predicted_s']:>7.3f} "
              f"{r['predicted_s'] / r['measured_s'] - 1:>+6.0%}  "
              f"{r['state_counted'] / 2**20:>9.2f} {r['state_predicted'] / 2**20:>7.2f}  "
              f"{r['act_measured'] / 2**20:>7.2f} {r['act_predicted'] / 2**20:>7.2f}")
    step_rho, step_err = summary(rows, "predicted_s", "measured_s")
    state_rho, state_err = summary(rows, "state_predicted", "state_counted")
    act_rho, act_err = summary(rows, "act_predicted", "act_measured")
    print(f"layouts={len(rows)} rounds={len(rounds)} "
          f"device={args.device or 'calibrated before each round'}")
    if len(rounds) > 1:
        noise = [spearman([a[n]["measured_s"] for n in args.layouts],
                          [b[n]["measured_s"] for n in args.layouts])
                 for a, b in zip(rounds, rounds[1:])]
        print("measured round against round: spearman=" + ", ".join(map(rho_text, noise)))
    print(f"weights+grads+optimizer: spearman={rho_text(state_rho)} mape={state_err:.2%}")
    print(f"activations: spearman={rho_text(act_rho)} mape={act_err:.1%}")
    print(f"step time: spearman={rho_text(step_rho)} mape={step_err:.1%} target_rho=0.9 "
          f"target_mape=15% ratio={step_err / 0.15:.3f}")


if __name__ == "__main__":
    main()
