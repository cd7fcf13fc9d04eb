"""The end of a ``hybrid-train -m`` sweep: wait for the cells submitted to Slurm, report each.

With ``launcher=slurm`` every cell of a multirun is its own job, submitted without waiting
(``launch.slurm``), so that the cluster runs them side by side; this Hydra callback then waits
for them all and prints one line per cell. The sweep exits 1 when a cell failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from launch.slurm import SWEEP_JOBS, job_failure, wait_for


def varying(cells: list[dict]) -> list[str]:
    """Each cell's overrides that not every cell shares: what the sweep varies."""
    shared = set.intersection(*(set(cell["overrides"]) for cell in cells))
    return [" ".join(o for o in cell["overrides"] if o not in shared) or "(the shared config)"
            for cell in cells]


def cell_line(cell: dict, settings: str, outcomes: list, failure: str | None) -> str:
    if failure is not None:
        return f"job {cell['job_id']} {settings}: failed: {failure}"
    losses = outcomes[0]["results"][0]["losses"]
    return (f"job {cell['job_id']} {settings}: completed, loss {losses[0]:.4f} -> "
            f"{losses[-1]:.4f}; run directory: {cell['run_dir']}")


class SlurmSweep(Callback):
    """Registered in ``conf/config.yaml``; does nothing in sweeps that submitted no job."""

    def on_multirun_end(self, config, **kwargs) -> None:
        from submitit import SlurmJob

        path = Path(config.hydra.sweep.dir) / SWEEP_JOBS
        if not path.exists():
            return
        cells = [json.loads(line) for line in path.read_text().splitlines() if line]
        print(f"waiting for the sweep's {len(cells)} slurm jobs", flush=True)
        failed = 0
        for cell, settings in zip(cells, varying(cells)):
            job = SlurmJob(folder=cell["folder"], job_id=cell["job_id"],
                           tasks=tuple(range(cell["nodes"])))
            outcomes = wait_for(job)
            failure = job_failure(outcomes, job)
            failed += failure is not None
            print(cell_line(cell, settings, outcomes, failure), flush=True)
        if failed:
            print(f"error: {failed} of {len(cells)} cells failed", file=sys.stderr)
            sys.exit(1)
