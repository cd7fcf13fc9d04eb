"""``train.overwrite=true`` starts clean: the replaced run (checkpoints, metrics, TensorBoard
events) is moved to ``RUN/.replaced-<time>/``, one line says so, and ``hybrid-ckpt show``,
``resume_from`` and ``hybrid-generate`` see only the new run's checkpoint; overwrite with a
resume of the same run is refused in one line (``launch/commands/replace_run.py``)."""

import subprocess
import sys
from pathlib import Path

import pytest

from launch.commands.replace_run import set_aside
from tests.refusals import refusal_in_process

BIN = Path(sys.executable).parent
COMMON = ["model=tiny", "data=synthetic", "parallel=single", "train.global_batch=2",
          "train.micro_batch=1", "train.log_every=100", "train.timeline_step=0",
          "optim.warmup_steps=1"]


def test_only_a_runs_own_files_are_moved(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "ckpts"
    for name in ("config.json", "metrics.jsonl", "notes.txt", "tensorboard/events",
                 "checkpoints/step_00000004/hybrid.json"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("old")
    line = set_aside(run, run / "checkpoints", stamp="T")
    assert "to " + str(run / ".replaced-T") in line, line
    assert sorted(p.name for p in run.iterdir()) == [".replaced-T", "notes.txt"]
    (elsewhere / "step_00000008").mkdir(parents=True)
    (elsewhere / "keep.txt").write_text("theirs")
    line = set_aside(run, elsewhere, stamp="T")  # the run dir holds no run now
    assert (elsewhere / ".replaced-T" / "step_00000008").is_dir(), line
    assert (elsewhere / "keep.txt").exists() and set_aside(run, elsewhere, "T") is None


@pytest.mark.parametrize("resume", ["auto", "RUN"])
def test_overwrite_with_a_resume_of_the_same_run_is_refused(tmp_path, resume):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    value = "auto" if resume == "auto" else str(run)
    if resume == "RUN":
        _fake_checkpoint(run / "checkpoints" / "step_00000004")
    line = refusal_in_process([*COMMON, "train.steps=8", "train.overwrite=true",
                               f"checkpoint.resume_from={value}"], run)
    assert "train.overwrite=true replaces the run in" in line and \
        "train.overwrite=false to continue it, checkpoint.resume_from=null to replace it" \
        in line, line


def _fake_checkpoint(path: Path) -> None:
    from hybrid.checkpoint.store import write_manifest
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")  # complete by its files; the refusal comes first
    write_manifest(path, {"format": 1, "step": 4, "model": {}, "files": {}, "tensors": {}})


def train(run: Path, *overrides: str) -> subprocess.CompletedProcess:
    done = subprocess.run([str(BIN / "hybrid-train"), *COMMON, f"hydra.run.dir={run}",
                           *overrides], capture_output=True, text=True, timeout=200)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return done


def greedy(source: Path) -> str:
    done = subprocess.run([str(BIN / "hybrid-generate"), str(source), "prompt_ids=1,2,3",
                           "max_new_tokens=8", "temperature=0"], capture_output=True,
                          text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_overwrite_moves_the_old_run_aside_and_every_command_sees_only_the_new_one(tmp_path):
    run = tmp_path / "run"
    train(run, "train.steps=8", "checkpoint.every=4", "seed=5")
    old_events = sorted(p.name for p in (run / "tensorboard").iterdir())
    done = train(run, "train.steps=2", "checkpoint.every=2", "train.overwrite=true")
    moved = [line for line in done.stderr.splitlines() if "moved the replaced run" in line]
    aside = next(run.glob(".replaced-*"))
    assert len(moved) == 1 and "its 2 checkpoints" in moved[0] and str(aside) in moved[0], moved
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == [
        "step_00000004", "step_00000008"]
    assert sorted(p.name for p in (aside / "tensorboard").iterdir()) == old_events
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000002"]
    assert not set(p.name for p in (run / "tensorboard").iterdir()) & set(old_events)
    shown = subprocess.run([str(BIN / "hybrid-ckpt"), "show", str(run)], capture_output=True,
                           text=True, timeout=60)
    assert shown.stdout.splitlines()[1].startswith("step 2 "), shown.stdout[:500]
    newest = greedy(run)
    assert newest == greedy(run / "checkpoints" / "step_00000002")
    assert newest != greedy(aside / "checkpoints" / "step_00000008")
    events = sorted(p.name for p in (run / "tensorboard").iterdir())
    resumed = train(run, "train.steps=4", f"checkpoint.resume_from={run}")
    assert "step_00000002" in resumed.stderr + resumed.stdout
    assert {r["step"] for r in _metrics(run)} == {1, 2, 3, 4}
    assert set(events) <= set(p.name for p in (run / "tensorboard").iterdir())  # kept


def _metrics(run: Path) -> list[dict]:
    from hybrid.metrics import read_metrics
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
