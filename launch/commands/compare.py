"""``hybrid-compare``: do runs of one config on different layouts train alike?

    hybrid-compare BASE RUN [RUN ...] [--rtol 1e-4] [--atol 0] [--jump 10] [--format text|json]

Each argument is a run directory of ``hybrid-train`` (or its ``metrics.jsonl``). The first is
the baseline, usually the 1-process run; every other run's loss is compared with it step by
step. A step stays within tolerance when ``|run - base| <= max(rtol * |base|, atol)``
(pytest.approx's rule, which the layout tests use); the default is DESIGN's fp32 layout
tolerance, relative 1e-4. Beyond it, a step whose relative difference is more than ``--jump``
(10) times the largest before it parts from the baseline (a real divergence jumps); one that
grew there step by step is float drift, said as such (``launch.reports.loss_compare``). The tolerance
is printed. Exit status: 0 when every run stays within tolerance or drifts, 1 when one parts
from the baseline, 2 for input that cannot be compared (one line on stderr each). Runs
of different lengths are compared over their common steps, and that is an error too (unless a
run parts: that verdict stands), except for a run that resumed the other's checkpoint: it lacks
only the steps before its first, and the common steps are the comparison.

The comparison itself is pure (``launch.reports.loss_compare``); this module reads the runs and
prints. It imports nothing heavy (no torch), so it answers at once.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn, Optional, Sequence, Union

from hybrid.errors import USER_ERROR_EXIT, UserError
from launch.reports.loss_compare import (JUMP, RTOL, CompareError, LossComparison, Run,
                                 compare_losses, lossy_differences, numerics_differences,
                                 resumed_from, span, summary_line, tolerance_line)

PARTED_EXIT = 1
METRICS = "metrics.jsonl"


def load_run(arg: Union[str, Path]) -> Run:
    path = Path(arg)
    metrics = path if path.is_file() else path / METRICS
    if not metrics.is_file():
        raise CompareError(_no_metrics(path))
    config_path = metrics.parent / "config.json"
    config = _read_json(config_path, config_path.read_text()) if config_path.is_file() else None
    return Run(str(arg), read_losses(metrics), config)


def _no_metrics(path: Path) -> str:
    if not path.exists():
        return f"{path} does not exist; pass run directories of hybrid-train (or metrics.jsonl)"
    cells = sorted((p.parent.name for p in path.glob(f"*/{METRICS}")), key=lambda n: (len(n), n))
    if cells:  # a sweep directory: its cells are the runs
        return (f"{path} has no {METRICS} but its cells do (a sweep); compare cells, e.g. "
                f"hybrid-compare {' '.join(str(path / c) for c in cells[:2])}")
    return f"{path} has no {METRICS}; pass a run directory of hybrid-train that trained a step"


def read_losses(path: Path) -> dict[int, float]:
    """Loss by step. A step written twice (an elastic restart re-runs it) counts as last
    written, as in hybrid.metrics; read here because that module imports torch."""
    losses = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = _read_json(f"{path} line {number}", line)
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) \
                or not isinstance(record.get("loss"), (int, float)):
            raise CompareError(f"{path} line {number} is not a metrics record (no numeric "
                               f"step and loss); pass a metrics.jsonl that hybrid-train wrote")
        losses[record["step"]] = float(record["loss"])
    if not losses:
        raise CompareError(f"{path} holds no step; the run ended before its first step did")
    return losses


def _read_json(where: Union[str, Path], text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise CompareError(f"{where} is not valid JSON ({err.msg}); is it still being "
                           f"written, or cut short?") from None


def check_finite(run: Run) -> None:
    bad = next((step for step, loss in sorted(run.losses.items()) if not math.isfinite(loss)),
               None)
    if bad is not None:
        raise CompareError(f"{run.name}: loss at step {bad} is {run.losses[bad]}; a run that "
                           f"diverged has nothing to compare: compare runs whose losses stay "
                           f"finite (e.g. with a lower optim.lr)")


def format_table(base_name: str, name: str, c: LossComparison) -> str:
    lines = [f"{base_name} (baseline) vs {name}",
             f"{'step':>6}  {'baseline':>14}  {'run':>14}  {'abs diff':>9}  {'rel diff':>9}"]
    for d in c.steps:
        mark = ("  <- parts here" if d is c.parted_at else "  <- drifts here" if d is
                c.drifts_from else "" if d.within else "  beyond tolerance")
        lines.append(f"{d.step:>6}  {d.base:>14.9g}  {d.run:>14.9g}  {d.abs_diff:>9.2e}  "
                     f"{d.rel_diff:>9.2e}{mark}")
    return "\n".join(lines)


def length_problem(base: Run, run: Run, c: LossComparison) -> Optional[str]:
    """Runs of different lengths, unless one resumed the other: then it has only the steps
    after its checkpoint, and the common steps are the comparison."""
    if not (c.base_only or c.run_only) or _resumed_suffix(base, run, c):
        return None
    return (f"{run.name} has {len(run.losses)} steps ({span(run.losses)}) and {base.name} "
            f"{len(base.losses)} ({span(base.losses)}): only the {len(c.steps)} common steps "
            f"were compared; compare runs that trained the same steps")


def _resumed_suffix(base: Run, run: Run, c: LossComparison) -> bool:
    """One run resumed (``checkpoint.resume_from``) and lacks only steps before its first."""
    for short, only in ((run, c.base_only), (base, c.run_only)):
        other_only = c.run_only if short is run else c.base_only
        if resumed_from(short.config) and not other_only and short.losses and \
                all(step < min(short.losses) for step in only):
            return True
    return False


def resume_note(base: Run, run: Run, c: LossComparison) -> Optional[str]:
    if not (c.base_only or c.run_only) or not _resumed_suffix(base, run, c):
        return None
    common = dict.fromkeys(d.step for d in c.steps)
    return (f"note: {run.name} and {base.name} overlap in steps {span(common)} (one resumed "
            f"the other's checkpoint): those were compared")


def config_note(base: Run, run: Run) -> Optional[str]:
    """Why a run may part: it computes something else, or with a lossy DP option (shown, not
    judged: exit codes follow the losses alone)."""
    if base.config is None or run.config is None:
        return None
    diffs = numerics_differences(base.config, run.config) + \
        lossy_differences(base.config, run.config)
    if not diffs:
        return None
    more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
    return (f"note: {run.name} differs from {base.name} in what it computes "
            f"({', '.join(diffs[:3])}{more}): its losses need not match")


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="hybrid-compare", description="Compare the per-step losses of runs with the "
        "first (the baseline), e.g. layouts of one config with its 1-process run.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories of hybrid-train (or metrics.jsonl files)")
    parser.add_argument("--rtol", type=float, default=RTOL,
                        help=f"relative tolerance per step (default {RTOL:g}: fp32 layouts)")
    parser.add_argument("--atol", type=float, default=0.0,
                        help="absolute tolerance per step (default 0)")
    parser.add_argument("--jump", type=float, default=JUMP,
                        help=f"beyond tolerance, a step parts when its relative difference is "
                             f"over this many times the largest before it, else it is float "
                             f"drift (default {JUMP:g})")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        _user_error(f"one run given ({args.runs[0]}); give the baseline and at least one run "
                    f"to compare with it")
    if not (args.rtol >= 0 and args.atol >= 0):  # also refuses nan
        _user_error(f"--rtol {args.rtol} and --atol {args.atol} must be numbers >= 0")
    if not 1 <= args.jump < math.inf:
        _user_error(f"--jump {args.jump} must be a finite number >= 1 (1: any growth beyond "
                    f"tolerance parts)")
    return args


def _user_error(message: Union[str, Exception]) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USER_ERROR_EXIT)


def _json(base: Run, results: list[tuple[Run, LossComparison]], args) -> str:
    runs = [{"run": run.name, "same": c.same, "summary": summary_line(run.name, base.name, c),
             "parted_at": c.parted_at.step if c.parted_at else None,
             "drifts_from": c.drifts_from.step if c.drifts_from else None,
             "largest_rel_diff": c.largest.rel_diff, "largest_rel_diff_step": c.largest.step,
             "compared_steps": len(c.steps), "base_only_steps": list(c.base_only),
             "run_only_steps": list(c.run_only),
             "config_differences": (numerics_differences(base.config, run.config)
                                    if base.config and run.config else None),
             "steps": [asdict(d) for d in c.steps]} for run, c in results]
    return json.dumps({"baseline": base.name, "rtol": args.rtol, "atol": args.atol,
                       "jump": args.jump, "runs": runs}, indent=1)


def _compare_all(args) -> tuple[Run, list[tuple[Run, LossComparison]]]:
    base, *runs = [load_run(arg) for arg in args.runs]
    for run in (base, *runs):
        check_finite(run)
    results = []
    for run in runs:
        try:
            c = compare_losses(base.losses, run.losses, rtol=args.rtol, atol=args.atol,
                               jump=args.jump)
        except CompareError as err:  # the pure function cannot name the runs
            raise CompareError(f"{run.name} and {base.name}: {err}") from None
        results.append((run, c))
    return base, results


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = _parse(argv)
    try:
        base, results = _compare_all(args)
    except (UserError, OSError) as err:
        _user_error(err)
    if args.format == "json":
        print(_json(base, results, args))
    else:
        print("\n\n".join(format_table(base.name, run.name, c) for run, c in results) + "\n")
        print(tolerance_line(args.rtol, args.atol, args.jump))
        for run, c in results:
            print(summary_line(run.name, base.name, c))
            for note in (config_note(base, run), resume_note(base, run, c)):
                if note:
                    print(note)
    problems = [p for p in (length_problem(base, run, c) for run, c in results) if p]
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if any(not c.same for _, c in results):
        sys.exit(PARTED_EXIT)  # a verdict on the losses outranks a warning about lengths
    if problems:
        sys.exit(USER_ERROR_EXIT)


if __name__ == "__main__":
    main()
