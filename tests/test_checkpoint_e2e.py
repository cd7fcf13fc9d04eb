"""Checkpoints through the real ``hybrid-train``: exact resume, resharding between layouts,
interrupted saves, elastic restart, and bad checkpoints refused before launch.

Every comparison is with an uninterrupted run of the same config (never a stored number): a
run of layout A saves at step 5 and goes on to step 10; a second run resumes from its step-5
checkpoint on layout B and must give A's losses for steps 6-10.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.metrics import read_metrics
from hybrid.testing.accounting import checked_records

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
CKPT = str(Path(sys.executable).parent / "hybrid-ckpt")
STEPS = 10
COMMON = ["model=tiny", "data=synthetic", "model.layers=8", f"train.steps={STEPS}",
          "train.global_batch=8", "train.micro_batch=2", "train.log_every=100",
          "train.timeline_step=0", "seed=11"]
SINGLE = ["parallel=single"]
LAYOUTS = {
    "2x2x2-zero1": ["parallel.zero=1"],
    "tp2": SINGLE + ["parallel.tp=2"],
    # several small gradient buckets per rank, interleaved stages
    "pp4-vpp2": SINGLE + ["parallel.pp=4", "parallel.vpp=2", "parallel.bucket_mb=0.01",
                          "parallel.schedule=interleaved-1f1b"],
    "dp4-zero2": SINGLE + ["parallel.dp=4", "parallel.zero=2", "parallel.bucket_mb=0.02"],
    # ZeRO-3's weight shards: saved whole from every layout, loaded into shards on any
    "2x2x2-zero3": ["parallel.zero=3", "parallel.bucket_mb=0.02"],
    "single": SINGLE,
    "dp2-zero3": SINGLE + ["parallel.dp=2", "parallel.zero=3", "parallel.bucket_mb=0.02"],
    # the DP options' own state (error feedback and Q; the mean in flight) is checkpointed
    "dp2-powersgd": SINGLE + ["parallel.dp=2", "parallel.dp_compress=powersgd",
                              "parallel.powersgd_warmup=3"],
    "dp2-delay": SINGLE + ["parallel.dp=2", "parallel.dp_delay=1"],
    # DualPipeV's V: rank 0 holds the first and last stage; saved by global names like any
    "pp2-dualpipev": SINGLE + ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=dualpipev"],
}

SOURCE_EXTRA = {"tp2": ["checkpoint.async_save=true"]}
"""The tp2 run saves with DCP's async save: its checkpoints must reshard like any other."""

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def run_train(run_dir: Path, *overrides: str, env=None, timeout: float = 240):
    return subprocess.run([TRAIN, *COMMON, f"hydra.run.dir={run_dir}", *overrides],
                          capture_output=True, text=True, timeout=timeout, env=env)


def last_loss_per_step(run_dir: Path) -> dict[int, float]:
    """The last record of each step (after an elastic restart a step may appear twice); and
    every rank held exactly the state bytes and sent exactly the DP bytes the plan predicts,
    resumed or not (``hybrid.testing.accounting.checked_records``)."""
    return {r["step"]: r["loss"] for r in checked_records(run_dir)}


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Uninterrupted 10-step runs of each source layout, saving at steps 5 and 10."""
    runs = {}

    def get(name: str) -> Path:
        if name not in runs:
            run_dir = tmp_path_factory.mktemp(f"saved-{name}")
            done = run_train(run_dir, *LAYOUTS[name], "checkpoint.every=5",
                             *SOURCE_EXTRA.get(name, []))
            assert done.returncode == 0, done.stderr[-3000:]
            assert step_dir(run_dir, 5).is_dir() and step_dir(run_dir, 10).is_dir()
            runs[name] = run_dir
        return runs[name]
    return get


def resume(run_dir: Path, source: Path, layout: str, *extra: str):
    done = run_train(run_dir, *LAYOUTS[layout],
                     f"checkpoint.resume_from={step_dir(source, 5)}", *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {step_dir(source, 5)} (step 5)" in done.stdout
    return last_loss_per_step(run_dir)


# 2x2x2 with ZeRO-1 resumes bitwise in the elastic-restart test below; dp_delay's mean in
# flight in the interrupted-save test.
@pytest.mark.parametrize("layout", ["dp2-powersgd"])
def test_resume_on_the_same_layout_is_bitwise(layout, saved, tmp_path):
    source = saved(layout)
    resumed = resume(tmp_path, source, layout)
    expected = last_loss_per_step(source)
    assert sorted(resumed) == list(range(6, STEPS + 1))
    assert [resumed[s] for s in resumed] == [expected[s] for s in resumed]  # bitwise


# Every axis changes: DP, TP, PP and the ZeRO stage at once (into ZeRO-2 on dp4, and into
# ZeRO-3's weight shards on dp2); TP into interleaved PP; ZeRO-3 on 2x2x2 into one process.
RESHARD = [("2x2x2-zero1", "dp4-zero2"), ("tp2", "pp4-vpp2"), ("2x2x2-zero3", "single"),
           ("2x2x2-zero1", "dp2-zero3"), ("pp2-dualpipev", "tp2")]


@pytest.mark.parametrize("source_layout, target_layout", RESHARD,
                         ids=[f"{a}->{b}" for a, b in RESHARD])
def test_resume_on_another_layout_continues_the_same_run(source_layout, target_layout,
                                                         saved, tmp_path):
    source = saved(source_layout)
    resumed = resume(tmp_path, source, target_layout)
    expected = last_loss_per_step(source)
    assert sorted(resumed) == list(range(6, STEPS + 1))
    assert [resumed[s] for s in resumed] == pytest.approx([expected[s] for s in resumed],
                                                          rel=1e-4)


def test_an_interrupted_save_leaves_the_previous_checkpoint_and_auto_picks_it(saved, tmp_path):
    first = tmp_path / "first"
    env = {**os.environ, "HYBRID_TEST_FAULT": "die_in_save:4:0"}
    done = run_train(first, *LAYOUTS["dp2-delay"], "checkpoint.every=2", env=env)
    assert done.returncode == 1 and "killed by signal SIGKILL" in done.stderr
    checkpoints = first / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002",
                                                             "step_00000004.tmp"]
    assert (checkpoints / "step_00000004.tmp" / ".metadata").exists()  # DCP had finished
    second = tmp_path / "second"
    done = run_train(second, *LAYOUTS["dp2-delay"], "checkpoint.every=2",
                     f"checkpoint.dir={checkpoints}", "checkpoint.resume_from=auto")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {checkpoints / 'step_00000002'} (step 2)" in done.stdout
    expected = last_loss_per_step(saved("dp2-delay"))  # the delayed mean resumes bitwise
    resumed = last_loss_per_step(second)
    assert sorted(resumed) == list(range(3, STEPS + 1))
    assert [resumed[s] for s in resumed] == [expected[s] for s in resumed]
    # the next save removed the interrupted one; keep=3 kept the newest three
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "step_00000006", "step_00000008", "step_00000010"]


def test_a_killed_worker_is_restarted_and_the_run_finishes_with_the_same_losses(saved,
                                                                              tmp_path):
    env = {**os.environ, "HYBRID_TEST_FAULT": "die_at_step:5:3"}
    done = run_train(tmp_path, *LAYOUTS["2x2x2-zero1"], "checkpoint.every=2",
                     "launcher.max_restarts=1", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]  # step 5 ran again after the restart
    assert last_loss_per_step(tmp_path) == last_loss_per_step(saved("2x2x2-zero1"))
    # What the console said: which rank died, why and where its log is; the restart; the
    # checkpoint the new group resumed from (before its first step); a summary of every step.
    died = re.search(r"warning: rank 3 died \(killed by signal SIGKILL\); its log: (\S+)",
                     done.stderr)
    assert died and Path(died[1]).is_dir() and died[1].startswith(str(tmp_path / "workers"))
    assert "warning: restarting all workers (1 of 1 restarts left)" in done.stderr
    out = done.stdout
    resumed = f"resumed from {step_dir(tmp_path, 4)} (step 4)"
    assert resumed in out and out.index(resumed) < out.index(
        f"checkpoint saved: {step_dir(tmp_path, 6)}")  # said at the start of the new attempt
    assert f"checkpoint saved: {step_dir(tmp_path, 10)} (training waited " in out
    assert "over 10 steps (1 restart)" in out
    assert "will restart worker group" in (tmp_path / "train.log").read_text()


def test_export_loads_into_the_one_process_model_with_the_parallel_loss(saved, tmp_path):
    source = saved("2x2x2-zero1")
    out = tmp_path / "model.pt"
    done = subprocess.run([CKPT, "export", str(step_dir(source, 5)), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from hybrid.testing import spawn

    (loss,) = spawn(_loss_of_exported, 1, str(out), 6)
    assert loss == pytest.approx(last_loss_per_step(source)[6], rel=1e-5)
    shown = subprocess.run([CKPT, "show", str(source)], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "step 10 (consumed samples 80)" in shown.stdout
    assert "saved from dp 2 x tp 2 x pp 2" in shown.stdout
    assert "model.blocks.8.mlp.fc2.weight" in shown.stdout
    assert "optim.embedding.word_embeddings.weight.exp_avg_sq" in shown.stdout


def _loss_of_exported(rank, world, path, step):
    """The 1-process model with the exported weights, on the global batch of ``step``."""
    import torch

    from hybrid.planning.config import DataConfig, ModelConfig
    from hybrid.data import make_dataset, rank_microbatches
    from hybrid.groups import ParallelGroups
    from hybrid.planning.layout import Layout
    from hybrid.model import GPT, load_global_weights

    cfg = ModelConfig(layers=8)
    model = GPT(cfg, ParallelGroups.create(Layout()), seed=0)  # other seed: loading must win
    load_global_weights(model.parameters(), torch.load(path, weights_only=True), model.groups)
    dataset = make_dataset(DataConfig(), cfg, seed=11)
    ((tokens, labels),) = rank_microbatches(dataset, step - 1, global_batch=8, micro_batch=8,
                                            dp=1, dp_rank=0, seed=11)
    with torch.no_grad():
        return float(model(tokens, labels))


def _truncated_copy(source: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy" / "step_00000005"
    shutil.copytree(step_dir(source, 5), copy)
    data = copy / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    return copy


def _without_metadata(source: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy" / "step_00000005"
    shutil.copytree(step_dir(source, 5), copy)
    (copy / ".metadata").unlink()
    return copy


def _model_mismatch(source: Path, tmp_path: Path) -> Path:
    return step_dir(source, 5)


BAD = [
    ("missing", lambda source, tmp: tmp / "nowhere", [], "does not exist"),
    ("partial", lambda source, tmp: (tmp / "step_00000003").mkdir() or tmp / "step_00000003",
     [], "is not a complete checkpoint"),
    ("empty run", lambda source, tmp: tmp, [], "holds no complete checkpoint"),
    ("no metadata", _without_metadata, [],
     "is damaged: it lacks DCP's .metadata, the index of its tensors (its hybrid.json is "
     "there)"),
    ("shape", _model_mismatch, ["model.hidden=64"],
     "model.hidden, model.ffn_hidden: the checkpoint step_00000005 has hidden=32, ffn=128, "
     "the config hidden=64, ffn=256; set model.hidden=32 model.ffn_hidden=128 to match it"),
    ("truncated", _truncated_copy, [], "is truncated or damaged"),
]


@pytest.mark.parametrize("name, make_path, extra, needle", BAD, ids=[b[0] for b in BAD])
def test_a_bad_checkpoint_is_refused_before_launch(name, make_path, extra, needle, saved,
                                                   tmp_path):
    path = make_path(saved("dp2-delay"), tmp_path)
    run_dir = tmp_path / "run"
    done = run_train(run_dir, *LAYOUTS["dp2-delay"], f"checkpoint.resume_from={path}", *extra,
                     timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not (run_dir / "workers").exists()


def test_a_corrupted_checkpoint_file_stops_the_workers_with_one_line(saved, tmp_path):
    copy = tmp_path / "step_00000005"
    shutil.copytree(step_dir(saved("dp2-delay"), 5), copy)
    data = copy / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only the checksum can tell
    data.write_bytes(bytes(raw))
    done = run_train(tmp_path / "run", *LAYOUTS["dp2-delay"], f"checkpoint.resume_from={copy}")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        rf"error: rank \d: checkpoint file {re.escape(str(data))} does not match the checksum "
        rf"written with it: it is corrupted; resume from an older checkpoint", lines[0]), lines
