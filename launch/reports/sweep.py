"""The end of a ``hybrid-train -m`` sweep: wait for the cells submitted to Slurm, then write
the sweep's report (``launch.reports.sweep_report``: sweep.csv, sweep.md, sweep.png).

With ``launcher=slurm`` every cell of a multirun is its own job, submitted without waiting
(``launch.launchers.slurm``), so that the cluster runs them side by side; this Hydra callback then waits
for them all and prints one line per cell. The sweep exits 1 when a cell failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from launch.launchers.slurm import SWEEP_JOBS
from launch.launchers.slurm_job import job_failure, wait_for
from launch.reports.sweep_report import record_cell, varying, write_report


def cell_line(cell: dict, settings: str, outcomes: list, failure: str | None) -> str:
    if failure is not None:
        return f"job {cell['job_id']} {settings}: failed: {failure}"
    losses = outcomes[0]["results"][0]["losses"]
    return (f"job {cell['job_id']} {settings}: completed, loss {losses[0]:.4f} -> "
            f"{losses[-1]:.4f}; run directory: {cell['run_dir']}")


def wait_for_slurm_cells(sweep_dir: Path) -> None:
    """Wait for every cell this sweep submitted; record and print how each ended."""
    from submitit import SlurmJob

    path = sweep_dir / SWEEP_JOBS
    if not path.exists():
        return
    cells = [json.loads(line) for line in path.read_text().splitlines() if line]
    print(f"waiting for the sweep's {len(cells)} slurm jobs", flush=True)
    for cell, settings in zip(cells, varying([c["overrides"] for c in cells])):
        job = SlurmJob(folder=cell["folder"], job_id=cell["job_id"],
                       tasks=tuple(range(cell["nodes"])))
        outcomes = wait_for(job)
        failure = job_failure(outcomes, job)
        record_cell(Path(cell["run_dir"]), "failed" if failure else "completed",
                    failure or "", cell["overrides"])
        print(cell_line(cell, settings, outcomes, failure), flush=True)


class SweepReport(Callback):
    """Registered in ``conf/config.yaml``; runs at the end of every multirun."""

    def on_multirun_end(self, config, **kwargs) -> None:
        from launch.reports.sweep_report import cell_rows

        sweep_dir = Path(config.hydra.sweep.dir)
        wait_for_slurm_cells(sweep_dir)
        report = write_report(sweep_dir)
        if report is None:
            return
        rows = cell_rows(sweep_dir)
        counts = {s: sum(r["status"] == s for r in rows) for s in ("completed", "skipped",
                                                                    "failed")}
        print(f"sweep report: {report} ({', '.join(f'{n} {s}' for s, n in counts.items())})",
              flush=True)
        if counts["failed"]:
            print(f"error: {counts['failed']} of {len(rows)} cells failed; see {report}",
                  file=sys.stderr)
            sys.exit(1)
