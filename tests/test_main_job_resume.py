"""Checkpoints of the README's main job, on its own data (``data=python-docs``), resumed and
exported as a user does: in a new run directory each, which reads the built-in corpus from the
machine's cache, not from the saved run's directory (#43: resume compared the data's paths and
refused every new run directory).

The main job (``main_job``: 2x2x2, 1F1B, 120 steps) saves at steps 116 and 120. Each resume
continues it from step 116 (four steps, the last with the validation loss: a resume is mostly
its start-up) and must give the uninterrupted run's losses, validation loss
included: bitwise on the same layout (from a data folder moved after the save), within float
tolerance on another layout (4 ranks, dp 2 x tp 2 with ZeRO-3: another world size, no
pipeline, sharded weights), and again from that run's ZeRO-3 checkpoint into one process.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.testing.accounting import checked_records

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
CKPT = str(Path(sys.executable).parent / "hybrid-ckpt")
RESUMED_AT = 116  # main_job's checkpoint.every
RESHARDED = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=1", "parallel.zero=3",
             "checkpoint.every=2"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """Each step's last ``key`` (state and DP bytes checked against the plan's prediction)."""
    return {r["step"]: r[key] for r in checked_records(run_dir) if key in r}


def resume(run_dir: Path, checkpoint: Path, *overrides: str) -> subprocess.CompletedProcess:
    done = subprocess.run([TRAIN, f"hydra.run.dir={run_dir}",
                           f"checkpoint.resume_from={checkpoint}", *overrides],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {checkpoint}" in done.stdout
    return done


@pytest.fixture(scope="module")
def resharded(main_job, tmp_path_factory) -> Path:
    """The main job resumed from step 116 on dp 2 x tp 2 with ZeRO-3, saving at 118 and 120."""
    run_dir = tmp_path_factory.mktemp("resharded")
    resume(run_dir, step_dir(main_job[0], RESUMED_AT), *RESHARDED)
    return run_dir


def test_a_resume_on_the_same_layout_from_a_moved_data_folder_is_bitwise(main_job, user_cache,
                                                                         tmp_path):
    source = main_job[0]
    moved = tmp_path / "moved-cache"
    shutil.move(user_cache / "examples", moved / "examples")
    try:
        done = resume(tmp_path / "run", step_dir(source, RESUMED_AT), f"data.cache_dir={moved}")
    finally:
        shutil.move(moved / "examples", user_cache / "examples")
    assert "data: built python-docs" not in done.stderr  # read where it lies, not rebuilt
    resumed, expected = losses(tmp_path / "run"), losses(source)
    assert sorted(resumed) == list(range(RESUMED_AT + 1, 121))
    assert [resumed[s] for s in resumed] == [expected[s] for s in resumed]  # bitwise
    assert losses(tmp_path / "run", "eval_loss") == {120: losses(source, "eval_loss")[120]}


def test_a_resume_on_another_layout_continues_the_main_job(main_job, resharded):
    resumed, expected = losses(resharded), losses(main_job[0])
    assert sorted(resumed) == list(range(RESUMED_AT + 1, 121))
    assert [resumed[s] for s in resumed] == pytest.approx([expected[s] for s in resumed],
                                                          rel=1e-4)
    assert losses(resharded, "eval_loss")[120] == pytest.approx(
        losses(main_job[0], "eval_loss")[120], rel=1e-4)


def test_a_zero3_checkpoint_of_it_resumes_in_one_process(main_job, resharded, tmp_path):
    resume(tmp_path, step_dir(resharded, RESUMED_AT + 2), "parallel=single")
    resumed, expected = losses(tmp_path), losses(main_job[0])
    assert sorted(resumed) == list(range(RESUMED_AT + 3, 121))
    assert [resumed[s] for s in resumed] == pytest.approx([expected[s] for s in resumed],
                                                          rel=1e-4)


def test_an_export_of_it_gives_the_one_process_model_its_loss(main_job, tmp_path):
    """``hybrid-ckpt export`` of step 116, loaded into the 1-process model, gives the loss the
    2x2x2 run had on step 117's global batch of the same data."""
    source = main_job[0]
    out = tmp_path / "model.pt"
    done = subprocess.run([CKPT, "export", str(step_dir(source, RESUMED_AT)), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from hybrid.testing import spawn

    batch = _global_batch(source, RESUMED_AT + 1)
    (loss,) = spawn(_loss_of_exported, 1, str(out), str(source), batch)
    assert loss == pytest.approx(losses(source)[RESUMED_AT + 1], rel=1e-5)


def _global_batch(run_dir: Path, step: int):
    """Step ``step``'s global batch of the run's own data, opened through its plan as its
    ranks did (here, before any process group: megatron's builder would want barriers)."""
    from hybrid.data import open_dataset, rank_microbatches
    from hybrid.planning.plan_file import load_plan

    plan = load_plan(run_dir)
    cfg = plan.cfg
    ((tokens, labels),) = rank_microbatches(open_dataset(plan), step - 1,
                                            global_batch=cfg.train.global_batch,
                                            micro_batch=cfg.train.global_batch, dp=1,
                                            dp_rank=0, seed=cfg.seed)
    return tokens, labels


def _loss_of_exported(rank, world, path, run_dir, batch):
    """The 1-process model with the exported weights, on ``batch``."""
    import torch

    from hybrid.groups import ParallelGroups
    from hybrid.model import GPT, load_global_weights
    from hybrid.planning.layout import Layout
    from hybrid.planning.plan_file import load_plan

    model = GPT(load_plan(run_dir).cfg.model, ParallelGroups.create(Layout()), seed=0)
    load_global_weights(model.parameters(), torch.load(path, weights_only=True), model.groups)
    with torch.no_grad():
        return float(model(*batch))


def test_generation_from_its_checkpoint_streams_text(main_job):
    """``hybrid-generate`` on the main job's run directory (its newest checkpoint, with the
    corpus's byte-level tokenizer): greedy text after the prompt."""
    done = subprocess.run([str(Path(sys.executable).parent / "hybrid-generate"),
                           str(main_job[0]), "prompt=The ", "max_new_tokens=24",
                           "temperature=0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("The ") and len(done.stdout.strip()) > len("The ") + 4
    assert "Traceback" not in done.stderr
