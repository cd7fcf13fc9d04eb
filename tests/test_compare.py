"""``hybrid-compare``: the pure loss comparison, the command on metrics written here (no
training), and one real check on ``hybrid-train`` runs."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from launch.reports.loss_compare import (CompareError, Run, compare_losses, deviations_from_reference,
                                 numerics_differences, summary_line)

COMPARE = str(Path(sys.executable).parent / "hybrid-compare")
LOSSES = [5.5, 5.1, 4.8, 4.6, 4.5, 4.45]
SINGLE = {"seed": 7, "parallel": {"dp": 1, "tp": 1, "pp": 1}, "train": {"micro_batch": 2}}

pytestmark = pytest.mark.timeout(60)


def test_identical_losses_are_the_same_with_no_difference():
    c = compare_losses(LOSSES, list(LOSSES))
    assert c.same and c.parted_at is None and len(c.steps) == 6
    assert all(d.abs_diff == d.rel_diff == 0 and d.within for d in c.steps)
    assert summary_line("B", "A", c) == \
        "B: same as A over 6 steps (largest relative difference 0 at step 1)"


def test_a_change_at_step_4_is_named():
    run = list(LOSSES)
    run[1] *= 1 + 3e-5  # within the fp32 layout tolerance: rounding, not a parting
    run[3] += 0.01
    run[4] = math.nan  # later steps beyond tolerance do not move the parting step
    c = compare_losses(LOSSES, run)
    assert not c.same and c.parted_at.step == 4 and c.largest.step == 5
    assert [d.step for d in c.steps if not d.within] == [4, 5]
    assert c.steps[1].rel_diff == pytest.approx(3e-5)
    assert summary_line("B", "A", c) == ("B: parts from A at step 4 (loss 4.6 vs 4.61, "
                                         "relative difference 0.00217 > rtol 0.0001)")
    assert compare_losses(LOSSES, run[:3], rtol=0, atol=1e-3).same  # steps 1-3 only


def test_runs_of_different_lengths_compare_their_common_steps():
    c = compare_losses(LOSSES, {2: 5.1, 3: 4.8, 7: 4.4})  # a mapping: loss by step
    assert [d.step for d in c.steps] == [2, 3]
    assert c.base_only == (1, 4, 5, 6) and c.run_only == (7,) and c.same
    with pytest.raises(CompareError, match="no step in common: the baseline has steps 1-6"):
        compare_losses(LOSSES, {10: 1.0})


def test_only_layout_settings_may_differ_and_the_reference_is_the_1_process_run():
    layout = {**SINGLE, "parallel": {"dp": 2, "tp": 1, "pp": 2}, "train": {"micro_batch": 1}}
    assert numerics_differences(SINGLE, layout) == []
    assert numerics_differences(SINGLE, {**layout, "seed": 8}) == ["seed: 7 vs 8"]
    runs = [Run("0", dict(enumerate(LOSSES, 1)), layout),  # no reference: a 2x1x2 cell
            Run("1", dict(enumerate(LOSSES, 1)), SINGLE),
            Run("2", dict(enumerate([x * (1 + 2e-6) for x in LOSSES], 1)), layout),
            None,  # a failed cell
            Run("4", dict(enumerate(LOSSES, 1)), {**layout, "seed": 8})]
    deviations = deviations_from_reference(runs)
    assert deviations[:2] == [(1, 0.0), (1, 0.0)] and deviations[3:] == [None, None]
    assert deviations[2][0] == 1 and deviations[2][1] == pytest.approx(2e-6)


def write_run(run_dir: Path, losses, config: dict | None = None) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": step, "loss": loss, "lr": 1e-3}) + "\n"
                for step, loss in enumerate(losses, 1)))
    if config is not None:
        (run_dir / "config.json").write_text(json.dumps(config))
    return run_dir


def compare(*args) -> subprocess.CompletedProcess:
    return subprocess.run([COMPARE, *map(str, args)], capture_output=True, text=True,
                          timeout=30)


def test_the_command_prints_a_table_and_one_line_per_run_and_exits_1_when_one_parts(tmp_path):
    base = write_run(tmp_path / "single", LOSSES, SINGLE)
    same = write_run(tmp_path / "dp2", LOSSES[:2] + [4.8 * (1 + 1e-6)] + LOSSES[3:])
    parted = write_run(tmp_path / "seed8", LOSSES[:3] + [4.7, 4.5, 4.45], {**SINGLE, "seed": 8})
    done = compare(base, same, parted)
    assert done.returncode == 1 and done.stderr == ""
    lines = done.stdout.splitlines()
    assert f"{same}: same as {base} over 6 steps (largest relative difference 1e-06 at " \
           f"step 3)" in lines
    assert f"{parted}: parts from {base} at step 4 (loss 4.6 vs 4.7, relative difference " \
           f"0.0217 > rtol 0.0001)" in lines
    assert f"note: {parted} differs from {base} in what it computes (seed: 7 vs 8): its " \
           f"losses need not match" in lines
    assert [line.split()[0] for line in lines if "<- parts here" in line] == ["4"]
    assert compare(base, same).returncode == 0
    assert compare(base, parted, "--rtol", "0.05").returncode == 0
    data = json.loads(compare(base, same, parted, "--format", "json").stdout)
    assert data["baseline"] == str(base) and data["rtol"] == 1e-4
    assert [r["parted_at"] for r in data["runs"]] == [None, 4]
    assert data["runs"][1]["config_differences"] == ["seed: 7 vs 8"]
    assert data["runs"][1]["steps"][3] == {"step": 4, "base": 4.6, "run": 4.7, "within": False,
                                           "abs_diff": pytest.approx(0.1),
                                           "rel_diff": pytest.approx(0.1 / 4.6)}


@pytest.mark.parametrize("case, expected", [
    ("missing", "{tmp}/missing does not exist; pass run directories of hybrid-train"),
    ("empty_dir", "{tmp}/empty_dir has no metrics.jsonl; pass a run directory"),
    ("sweep", "{tmp}/sweep has no metrics.jsonl but its cells do (a sweep); compare cells, "
              "e.g. hybrid-compare {tmp}/sweep/0 {tmp}/sweep/1"),
    ("nan", "{tmp}/nan: loss at step 2 is nan; a run that diverged has nothing to compare"),
    ("torn", "{tmp}/torn/metrics.jsonl line 3 is not valid JSON"),
    ("only_one", "one run given ({tmp}/base); give the baseline and at least one run"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case, expected):
    base = write_run(tmp_path / "base", LOSSES)
    (tmp_path / "empty_dir").mkdir()
    for cell in ("0", "1"):
        write_run(tmp_path / "sweep" / cell, LOSSES)
    write_run(tmp_path / "nan", [5.5, math.nan, 4.8])
    write_run(tmp_path / "torn", LOSSES[:2])
    with open(tmp_path / "torn" / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "lo')  # a run killed while writing
    done = compare(base) if case == "only_one" else compare(base, tmp_path / case)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: " + expected.format(tmp=tmp_path)), done.stderr


def test_runs_of_different_lengths_are_compared_over_common_steps_then_exit_2(tmp_path):
    base, short = write_run(tmp_path / "base", LOSSES), write_run(tmp_path / "short", LOSSES[:4])
    done = compare(base, short)
    assert done.returncode == 2
    assert f"{short}: same as {base} over 4 steps" in done.stdout
    assert done.stderr == (f"error: {short} has 4 steps (1-4) and {base} 6 (1-6): only the 4 "
                           f"common steps were compared; compare runs that trained the same "
                           f"steps\n")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_runs_same_config_report_0_difference_and_tied_embeddings_part_at_step_1(
        reference_runs, tmp_path):
    """The untied 1-process reference run again (1 run), and the untied against the tied one."""
    from test_train_e2e import STEPS, run_train

    base, tied, again = reference_runs["untied"], reference_runs["tied"], tmp_path / "again"
    done = run_train(again, "parallel=single")
    assert done.returncode == 0, done.stderr[-3000:]
    done = compare(base, again)
    assert done.returncode == 0, done.stderr
    assert f"{again}: same as {base} over {STEPS} steps (largest relative difference 0 at " \
           f"step 1)" in done.stdout.splitlines()
    done = compare(base, tied)
    assert done.returncode == 1, done.stderr
    assert f"{tied}: parts from {base} at step 1 (loss " in done.stdout
    assert f"note: {tied} differs from {base} in what it computes (model.tie_embeddings: " \
           f"False vs True)" in done.stdout


# The main job's 120-step case (#43): 2x2x2 and cp2 against one process, steps 1-16 alike,
# relative 2.5e-4 at step 17. Float drift: rounding differences from 1e-7 growing 1.55x a
# step (the main job's 2x2x2 run grows by 2.7-5x a step at most near step 17). A divergence:
# 1e-7 until step 16, then the same 2.5e-4 at once.
BASE = [5.6 - 0.02 * step for step in range(1, 31)]
DRIFT = [loss * (1 + 1e-7 * 1.55 ** (step - 1)) for step, loss in enumerate(BASE, 1)]
JUMPED = [loss * (1 + (1e-7 if step < 17 else 2.5e-4 * 1.1 ** (step - 17)))
          for step, loss in enumerate(BASE, 1)]


def test_float_drift_is_told_from_a_divergence_by_how_the_difference_got_there():
    drift, jumped = compare_losses(BASE, DRIFT), compare_losses(BASE, JUMPED)
    assert drift.same and drift.parted_at is None
    assert drift.drifts_from.step == 17
    assert drift.drifts_from.rel_diff == pytest.approx(1e-7 * 1.55 ** 16, rel=1e-6)
    assert summary_line("cp2", "single", drift).startswith(
        "cp2: drifts from single beyond tolerance from step 17 (relative difference 0.000111, "
        "grown there a step at a time, at most 10x the largest before: float drift, not a "
        "divergence; largest ")
    assert not jumped.same and jumped.parted_at.step == 17 and jumped.drifts_from is None
    assert summary_line("cp2", "single", jumped) == (
        f"cp2: parts from single at step 17 (loss {BASE[16]:.9g} vs {JUMPED[16]:.9g}, relative "
        f"difference 0.00025 > rtol 0.0001)")
    # a divergence after the drift has crossed the tolerance still parts, at the jump
    late = DRIFT[:19] + [loss * 1.05 for loss in BASE[19:]]
    assert compare_losses(BASE, late).parted_at.step == 20
    # the jump factor is the user's: 1 parts at any growth beyond tolerance
    assert compare_losses(BASE, DRIFT, jump=1).parted_at.step == 17
    assert compare_losses(BASE, DRIFT[:20], rtol=1e-2).drifts_from is None


def test_the_command_prints_its_tolerance_and_exits_0_on_drift_1_on_a_jump(tmp_path):
    base = write_run(tmp_path / "single", BASE, SINGLE)
    drift = write_run(tmp_path / "cp2", DRIFT, SINGLE)
    jumped = write_run(tmp_path / "dp2", JUMPED, SINGLE)
    done = compare(base, drift)
    assert done.returncode == 0, done.stdout
    lines = done.stdout.splitlines()
    assert ("tolerance: a step is alike within relative 0.0001 of the baseline (--rtol, --atol); "
            "beyond it, a relative difference over 10x the largest before it is a divergence "
            "(--jump), one that grew there is float drift") in lines
    assert any(line.startswith(f"{drift}: drifts from {base} beyond tolerance from step 17")
               for line in lines)
    assert [line.split()[0] for line in lines if "<- drifts here" in line] == ["17"]
    done = compare(base, jumped, "--rtol", "1e-5", "--atol", "1e-6", "--jump", "20")
    assert done.returncode == 1
    assert ("tolerance: a step is alike within max(rtol 1e-05 x |loss|, atol 1e-06) of the "
            "baseline (--rtol, --atol); beyond it, a relative difference over 20x the largest "
            "before it is a divergence (--jump), one that grew there is float drift") \
        in done.stdout.splitlines()
    data = json.loads(compare(base, drift, jumped, "--format", "json").stdout)
    assert data["jump"] == 10 and [(r["same"], r["parted_at"], r["drifts_from"])
                                   for r in data["runs"]] == [(True, None, 17), (False, 17, None)]
    assert compare(base, drift, "--jump", "1").returncode == 1
    bad = compare(base, drift, "--jump", "0.5")
    assert bad.returncode == 2 and bad.stderr == ("error: --jump 0.5 must be a finite number >= 1 "
                                                  "(1: any growth beyond tolerance parts)\n")
