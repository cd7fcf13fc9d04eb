"""Sweeps: every cell of ``hybrid-train -m`` runs (a bad cell is skipped, a failing one
recorded, the sweep goes on) and the sweep ends with one report; ``hybrid-plan search.run``
trains the best layouts of a search as such a sweep."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.sweep_report import spearman

BIN = Path(sys.executable).parent
TINY = ["model=tiny", "train.steps=3", "train.global_batch=4", "train.log_every=100",
        "optim.warmup_steps=0"]

pytestmark = pytest.mark.timeout(240)


def report_rows(sweep_dir: Path) -> dict[str, dict]:
    with open(sweep_dir / "sweep.csv") as handle:
        return {row["cell"]: row for row in csv.DictReader(handle)}


def test_a_sweep_skips_bad_cells_records_failures_goes_on_and_reports(tmp_path):
    """Four cells: tp=3 cannot split the tiny model (skipped, twice), rank 1 is killed in the
    dp=2 cell (failed), the dp=1 cell trains; the report holds all four, best first."""
    done = subprocess.run(
        [str(BIN / "hybrid-train"), "-m", *TINY, "parallel=single", "parallel.dp=1,2",
         "parallel.tp=1,3", f"hydra.sweep.dir={tmp_path}"], capture_output=True, text=True,
        timeout=200, env={**os.environ, "HYBRID_TEST_FAULT": "die_at_step:2:1"})
    assert done.returncode == 1, done.stderr[-3000:]  # a cell failed
    assert f"sweep report: {tmp_path / 'sweep.md'} (1 completed, 2 skipped, 1 failed)" \
        in done.stdout
    rows = report_rows(tmp_path)
    assert {cell: row["status"] for cell, row in rows.items()} == {
        "0": "completed", "1": "skipped", "2": "failed", "3": "skipped"}
    assert rows["1"]["settings"] == "parallel.dp=1 parallel.tp=3"
    assert rows["1"]["reason"].startswith("parallel.tp=3 does not divide model.heads=4")
    assert rows["2"]["reason"].startswith("rank 1 failed: killed by signal SIGKILL")
    done_row = rows["0"]
    for key in ("tokens_per_s", "step_time_s", "peak_mem_bytes", "predicted_step_time_s",
                "predicted_mem_bytes_per_rank"):
        assert float(done_row[key]) > 0, key
    assert rows["2"]["tokens_per_s"] == ""  # a failed run's first steps are not measurements
    table = (tmp_path / "sweep.md").read_text().splitlines()
    assert table[4].startswith("| 0 | parallel.dp=1 parallel.tp=1 | completed |")  # best first
    assert (tmp_path / "sweep.png").stat().st_size > 5000


def test_search_run_trains_the_top_layouts_and_reports_measured_beside_predicted(tmp_path):
    done = subprocess.run(
        [str(BIN / "hybrid-plan"), *TINY, "train.timeline_step=0", "search.world=1",
         "search.top=2", "search.run=true", f"search.dir={tmp_path}"],
        capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"sweep report: {tmp_path / 'sweep.md'}" in done.stdout
    rows = report_rows(tmp_path)
    assert sorted(rows) == ["0", "1"] and all(r["status"] == "completed" for r in rows.values())
    assert all(float(r["tokens_per_s"]) > 0 and float(r["predicted_step_time_s"]) > 0
               for r in rows.values())
    assert len({r["settings"] for r in rows.values()}) == 2  # two different layouts


def test_spearman_rank_correlation():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)  # ties: mean rank
    assert spearman([1, 2], [2, 1]) is None
