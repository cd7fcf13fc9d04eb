"""One report of a layout sweep: ``sweep.csv``, ``sweep.md`` and ``sweep.png`` in the sweep
directory, one row per cell, best first.

A cell is a run directory below the sweep directory (Hydra's ``0``, ``1``, ... of a multirun,
or those ``hybrid-plan search.run=true`` fills). Each holds ``cell.json`` (status:
completed, skipped or failed, and the reason) written by ``hybrid-train``, the resolved
``config.json``, and for a run that trained, ``metrics.jsonl`` and ``timeline_bubble.json``.
The report puts what was measured (tokens/s and step time: the median over the steps after
the first; peak memory; the measured pipeline bubble; communication bytes per axis and step)
beside what the cost model predicted for the same config (``cost.device``), and says how
well the prediction ordered the layouts (Spearman's rank correlation of predicted and
measured step times). Where the sweep holds a completed 1-process cell (dp = tp = pp = 1)
whose config differs from a completed cell's in layout settings only (model, seed, data,
optimizer and steps the same: ``launch.reports.loss_compare.LAYOUT_ONLY``), that cell's
``max_loss_dev`` is its largest relative difference in per-step loss from the 1-process cell
(``hybrid-compare``'s comparison): layout invariance, checked for every cell.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path
from typing import Optional

from hybrid.step_record import COUNTED as COMM_AXES  # the layout's axes and the experts' a2a
from launch.commands.compare import load_run
from launch.reports.loss_compare import CompareError, deviations_from_reference

CELL_FILE = "cell.json"
COLUMNS = ("cell", "settings", "status", "reason", "tokens_per_s", "step_time_s",
           "peak_mem_bytes", "bubble_measured", *(f"comm_bytes_{axis}" for axis in COMM_AXES),
           "predicted_step_time_s", "predicted_mem_bytes_per_rank", "max_loss_dev",
           "loss_reference", "predicted_on", "assumes", "replica_speed", "dp_balance_saving")


def record_cell(run_dir: Path, status: str, reason: str = "", settings: Optional[list] = None,
                ) -> None:
    from hybrid.files import write_text

    write_text(run_dir / CELL_FILE, json.dumps({"status": status, "reason": reason,
                                                "settings": settings or []}) + "\n")


def cell_rows(sweep_dir: Path) -> list[dict]:
    cells = sorted((p.parent for p in sweep_dir.glob(f"*/{CELL_FILE}")),
                   key=lambda p: (len(p.name), p.name))
    records = [json.loads((cell / CELL_FILE).read_text()) for cell in cells]
    settings = varying([r["settings"] for r in records])
    rows = [_row(cell, record, shown) for cell, record, shown in zip(cells, records, settings)]
    _add_loss_deviations(rows, cells)
    return rows


def _add_loss_deviations(rows: list[dict], cells: list[Path]) -> None:
    """``max_loss_dev`` and ``loss_reference`` (the 1-process cell compared with), where a
    completed cell has such a reference."""
    runs = []
    for row, cell in zip(rows, cells):
        try:  # a cell without metrics just has no deviation: the report still gets written
            runs.append(load_run(cell) if row["status"] == "completed" else None)
        except (CompareError, OSError):
            runs.append(None)
    for row, deviation in zip(rows, deviations_from_reference(runs)):
        if deviation is not None:
            reference, largest = deviation
            row.update(loss_reference=cells[reference].name, max_loss_dev=largest)


def varying(settings: list[list[str]]) -> list[str]:
    """Each cell's overrides that not every cell shares: what the sweep varies."""
    if not settings:
        return []
    shared = set.intersection(*(set(s) for s in settings))
    return [" ".join(o for o in s if o not in shared) or "(the shared config)" for s in settings]


def _row(cell: Path, record: dict, settings: str) -> dict:
    row = dict.fromkeys(COLUMNS, "")
    row.update(cell=cell.name, settings=settings, status=record["status"],
               reason=record["reason"])
    if record["status"] == "completed":  # a failed run's first steps would mislead
        row.update(_measured(cell))
    row.update(_predicted(cell))
    if record["status"] == "completed":
        row.update(_balance_saving(cell))
    return row


def _measured(cell: Path) -> dict:
    path = cell / "metrics.jsonl"
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line]
    steady = records[1:] or records  # the first step pays for warm-up
    out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
           "step_time_s": statistics.median(r["step_time_s"] for r in steady),
           "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records)}
    for axis, nbytes in records[-1]["comm_bytes"].items():
        out[f"comm_bytes_{axis}"] = nbytes
    bubble = cell / "timeline_bubble.json"
    if bubble.exists():
        out["bubble_measured"] = json.loads(bubble.read_text())["measured"]
    return out


def _predicted(cell: Path) -> dict:
    from hybrid.planning.config import from_dict
    from hybrid.errors import UserError
    from hybrid.planning.cost.devices import DeviceError
    from hybrid.planning.cost.steptime import predict_step
    from hybrid.planning.cost.trust import assumption_line
    from hybrid.planning.job import plan_job

    path = cell / "config.json"
    if not path.exists():
        return {}
    cfg = from_dict(json.loads(path.read_text()))
    try:
        device = prediction_device(cfg.cost.device)
        p = predict_step(plan_job(cfg), device)
    except DeviceError as err:  # a stale device file: said in the report, never used
        return {"assumes": f"no prediction: {err}"}
    except UserError:
        return {}
    return {"predicted_step_time_s": p.step_time_s,
            "predicted_mem_bytes_per_rank": p.mem_bytes_per_rank,
            "predicted_on": device.name, "assumes": assumption_line(device, cfg)}


def _balance_saving(cell: Path) -> dict:
    """A cell of more than one DP replica under even shares: its replicas' speeds as
    measured (``rank_times.jsonl``, the steps after the first) and what
    ``parallel.dp_balance=dynamic`` would save at them, by the cost model."""
    from hybrid.errors import UserError
    from hybrid.planning.config import from_dict
    from hybrid.planning.cost.replicas import measured_speeds, replica_prediction
    from hybrid.planning.job import plan_job

    times, config = cell / "rank_times.jsonl", cell / "config.json"
    if not (times.exists() and config.exists()):
        return {}
    cfg = from_dict(json.loads(config.read_text()))
    if cfg.parallel.dp < 2 or cfg.parallel.dp_balance != "even":
        return {}
    lines = [json.loads(line) for line in times.read_text().splitlines() if line]
    try:
        plan = plan_job(cfg)
        dp_of_rank = [plan.layout.coords(r)["dp"] for r in range(plan.layout.world_size)]
        speeds = measured_speeds([line["compute_s"] for line in lines[1:] or lines],
                                 dp_of_rank, cfg.parallel.dp)
        p = replica_prediction(plan, prediction_device(cfg.cost.device), speeds)
    except UserError:
        return {}
    return {"replica_speed": speeds, "dp_balance_saving": 1 - p["ratio"]}


def _balance_note(rows: list[dict]) -> str:
    """What balancing the DP replicas by their measured speed would save, per cell."""
    priced = [r for r in rows if r["dp_balance_saving"] != ""]
    if not priced:
        return ("Balancing: no completed cell of parallel.dp > 1 under even shares to price "
                "parallel.dp_balance=dynamic for.")
    said = "; ".join(f"cell {r['cell']} {r['dp_balance_saving']:.0%} (replica speeds "
                     f"{r['replica_speed']})" for r in priced)
    return (f"Balancing: parallel.dp_balance=dynamic would save, by the cost model at each "
            f"cell's measured replica speeds: {said}.")


def prediction_device(name: str):
    """``cost.device``, except that the default uncalibrated ``cpu`` preset gives way to this
    host's calibration when ``hybrid-plan calibrate`` has written one: a sweep measures this
    machine, and its predictions should be for it. The file's path and age go into every
    prediction's ``assumes``; a file from another host or hybrid is not used, and the ``cpu``
    preset's ``assumes`` says why."""
    from dataclasses import replace

    from hybrid.planning.cost.devices import DeviceError, calibrated_path, load_device

    if name == "cpu" and calibrated_path().is_file():
        try:
            return load_device("calibrated")
        except DeviceError as err:
            cpu = load_device("cpu")
            return replace(cpu, error=f"{cpu.error}; the calibration was not used: {err}")
    return load_device(name)


def best_first(rows: list[dict]) -> list[dict]:
    """Completed cells by measured tokens/s (highest first), then the others in cell order."""
    done = [r for r in rows if r["status"] == "completed" and r["tokens_per_s"] != ""]
    rest = [r for r in rows if r not in done]
    return sorted(done, key=lambda r: -r["tokens_per_s"]) + rest


def spearman(xs: list[float], ys: list[float]) -> Optional[float]:
    """Spearman's rank correlation (ties get their mean rank); None under 3 points."""
    if len(xs) < 3:
        return None

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else None


def write_report(sweep_dir: Path) -> Optional[Path]:
    """Write sweep.csv, sweep.md and sweep.png; the markdown's path, or None without cells."""
    rows = best_first(cell_rows(sweep_dir))
    if not rows:
        return None
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    (sweep_dir / "sweep.csv").write_text(out.getvalue())
    (sweep_dir / "sweep.md").write_text(markdown(rows))
    _plot(rows, sweep_dir / "sweep.png")
    return sweep_dir / "sweep.md"


def _fmt(value, scale: float = 1, digits: str = ".3g") -> str:
    return "" if value == "" else format(value / scale, digits)


def markdown(rows: list[dict]) -> str:
    lines = ["# Sweep", "", "| cell | settings | status | tokens/s | step s | predicted step s "
             f"| peak mem GiB | predicted mem/rank GiB | bubble | comm MiB {'/'.join(COMM_AXES)} "
             "| loss dev "
             "| reason |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        comm = "/".join(_fmt(r[f"comm_bytes_{a}"], 2**20) for a in COMM_AXES)
        cells = [r["cell"], r["settings"], r["status"], _fmt(r["tokens_per_s"], 1, ",.0f"),
                 _fmt(r["step_time_s"]), _fmt(r["predicted_step_time_s"]),
                 _fmt(r["peak_mem_bytes"], 2**30), _fmt(r["predicted_mem_bytes_per_rank"], 2**30),
                 _fmt(r["bubble_measured"], 1, ".1%"), comm if comm.strip("/") else "",
                 _fmt(r["max_loss_dev"], 1, ".2g"), r["reason"]]
        lines.append("| " + " | ".join(cells) + " |")
    done = [r for r in rows if r["status"] == "completed" and r["predicted_step_time_s"] != ""]
    rho = spearman([r["predicted_step_time_s"] for r in done], [r["step_time_s"] for r in done])
    lines += ["", _balance_note(rows), "", _loss_note(rows), "", "Predicted vs measured order of step times: " +
              (f"Spearman {rho:.2f} over {len(done)} cells" if rho is not None
               else "fewer than 3 completed cells"), "", _error_note(rows, done)]
    return "\n".join(lines) + "\n"


def _error_note(rows: list[dict], done: list[dict]) -> str:
    """What the predictions assumed, and their error over this sweep's completed cells."""
    assumed = sorted({r["assumes"] for r in rows if r["assumes"] != ""})
    said = " / ".join(assumed)
    head = (said[:1].upper() + said[1:] + "." if said
            else "Predictions: none (no cell's config could be priced).")
    if not done:
        return head
    errors = [r["predicted_step_time_s"] / r["step_time_s"] - 1 for r in done]
    worst = max(errors, key=abs)
    return (f"{head} Here, predicted step time against measured: mean |error| "
            f"{statistics.mean(abs(e) for e in errors):.0%}, worst {worst:+.0%}, over "
            f"{len(done)} completed cells.")


def _loss_note(rows: list[dict]) -> str:
    refs = sorted({r["loss_reference"] for r in rows if r["loss_reference"] != ""},
                  key=lambda name: (len(name), name))
    if not refs:
        return ("Loss dev: no completed 1-process cell (parallel.dp=tp=pp=1) of the same "
                "config to compare losses with; add one to check every layout against it.")
    return (f"Loss dev: each cell's largest relative difference in per-step loss from the "
            f"1-process cell{'s' if len(refs) > 1 else ''} {', '.join(refs)} (`hybrid-compare` "
            f"shows every step); the layouts of an fp32 run stay within 1e-4.")


def _plot(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    done = [r for r in rows if r["tokens_per_s"] != ""]
    figure = Figure(figsize=(max(6, 1 + 0.9 * len(done)), 6))
    FigureCanvasAgg(figure)
    speed, memory = figure.subplots(2, 1, sharex=True)
    labels = [r["settings"] or r["cell"] for r in done]
    speed.bar(range(len(done)), [r["tokens_per_s"] for r in done], color="tab:blue")
    speed.set_ylabel("tokens/s (measured)")
    memory.bar(range(len(done)), [r["peak_mem_bytes"] / 2**30 for r in done], color="tab:orange")
    memory.set_ylabel("peak memory GiB")
    memory.set_xticks(range(len(done)), labels, rotation=30, ha="right", fontsize=8)
    speed.set_title("sweep: each completed cell, best first")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
