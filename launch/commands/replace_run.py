"""``train.overwrite=true``: the replaced run is moved aside, whole, before the new one writes
anything, so the two never mix: its checkpoints would outrank the new run's (``resume_from``,
``hybrid-ckpt show``, ``hybrid-generate`` take the newest step) and ``checkpoint.keep`` would
prune the new run's; its metrics and TensorBoard events would run on into the new ones.

Nothing is deleted: the old run goes to ``RUN/.replaced-<time>/`` (its checkpoints with it;
a ``checkpoint.dir`` outside the run directory keeps them in ``DIR/.replaced-<time>/``), which
no command reads as a run or a checkpoint (hidden, not ``step_*``). One console line says
what moved and where.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

from hybrid.checkpoint.store import complete_checkpoints

RUN_OUTPUTS = ("config.json", "plan.json", "metrics.jsonl", "memory_check.json",
               "rank_times.jsonl", "block_costs.json", "failure.json", "slurm_jobs.jsonl",
               "tensorboard", "workers", "checkpoints", "timeline*")
"""What a run writes in its run directory (glob patterns); nothing else there is moved (the
run directory may be a person's working directory), nor this run's Hydra files (``.hydra``,
``train.log``), already written."""
HELD_RUN = ("config.json", "metrics.jsonl")
REPLACED = ".replaced-"


def set_aside(run_dir: Path, checkpoint_dir: Path, stamp: Optional[str] = None
              ) -> Optional[str]:
    """Move the old run's files out of ``run_dir`` (and its ``step_*`` out of
    ``checkpoint_dir``) into ``.replaced-<stamp>/``; the console line, or None when there
    was nothing to move."""
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    run_dir, checkpoint_dir = Path(run_dir).resolve(), Path(checkpoint_dir).resolve()
    held = len(complete_checkpoints(checkpoint_dir)) if checkpoint_dir.is_dir() else 0
    moves = []
    if any((run_dir / name).exists() for name in HELD_RUN):
        moves.append((run_dir, sorted({p for pattern in RUN_OUTPUTS
                                       for p in run_dir.glob(pattern)})))
    if checkpoint_dir != run_dir / "checkpoints" or not moves:
        moves.append((checkpoint_dir, sorted(checkpoint_dir.glob("step_*"))))
    places = []
    for parent, entries in moves:
        if entries:
            target = _free_name(parent / f"{REPLACED}{stamp}")
            target.mkdir()
            for entry in entries:
                entry.rename(target / entry.name)
            places.append(str(target))
    if not places:
        return None
    what = f"its {held} checkpoint{'s' * (held != 1)} and every file it wrote"
    return (f"train.overwrite=true: moved the replaced run ({what}) aside to "
            f"{' and '.join(places)}; delete it there when it is not wanted")


def _free_name(path: Path) -> Path:
    """``path``, or ``path-1``, ``path-2``... when two runs are replaced within a second."""
    candidate, suffix = path, 0
    while candidate.exists():
        suffix += 1
        candidate = path.with_name(f"{path.name}-{suffix}")
    return candidate


def replace_old_run(run_dir: Path, checkpoint_dir: Path) -> None:
    line = set_aside(run_dir, checkpoint_dir)
    if line is not None:
        print(line, file=sys.stderr)
