"""``parallel.pp_balance=dynamic`` through ``hybrid-train`` (issue 55), on pp2 with 8 layers:
two runs, each checking several things:

- the static run is the reference (the split of ``parallel.partition``, all run);
- a dynamic run whose stage 1 is slowed (``hybrid.diagnosis.faults``' slow: it sleeps in
  every step's compute, so the split moves within the first decisions, whatever the machine's
  load) gives stage 1 fewer layers, the state moved through a checkpoint at the step
  boundary, and its losses equal the static run's (rtol 1e-5): the math does not change;
- it checkpoints at step 6, after the move: the checkpoint's manifest holds the split that
  step 7 runs on (what a resume continues on, ``tests/test_pp_balance.py``);
- the move is in memory (``parallel.pp_balance_move=memory``, the default): no
  ``pp_balance`` directory is ever written (a file of that name sits where it would go), and
  the same run moving through the checkpoint (``=checkpoint``) gives the same losses and the
  same step-6 checkpoint, bitwise;
- the same three runs on dp2 x tp2 x pp2 under ZeRO-3 (8 ranks): the weights that move are
  each TP shard, gathered whole over DP and sharded again on the new stage;
- and on dp2 x pp2 of an MoE model with expert biases under PowerSGD (compressing from step
  3, before the move): its error feedback and ``Q`` move with their layers, and so do the
  biases.

Step times are not asserted here (the machine is shared): ``bench/pp_balance.py`` measures
them, with a stage's worker throttled from outside (SIGSTOP/SIGCONT cycles). The decision
logic (a slowdown starts and stops; an undisturbed noisy run) is in
``tests/test_pp_balance.py``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hybrid.checkpoint.dcp_io import SafeReader, read_metadata
from hybrid.checkpoint.store import read_manifest
from hybrid.checkpoint.weights import single_process
from hybrid.planning.stage_balance import layer_counts
from hybrid.testing.accounting import checked_records

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
COMMON = ["model=tiny", "model.layers=8", "model.seq_len=16", "data=synthetic",
          "parallel=single", "parallel.pp=2", "train.micro_batch=2", "train.global_batch=8",
          "train.timeline_step=0", "train.log_every=1000", "train.collective_timeout_s=120",
          "parallel.pp_balance_every=2", "train.steps=8"]
SLOW = "slow:1:1:0.2"
"""Global rank 1 (pipeline stage 1 on pp2) sleeps 0.2 s in every step from step 1."""
DP_TP = ["parallel.dp=2", "parallel.tp=2", "parallel/dp=zero3"]
SLOW_DP_TP = "slow:1:4:0.2"
"""Global rank 4 (dp 0, tp 0 of stage 1 on dp2 x tp2 x pp2) sleeps likewise."""
MOE_POWERSGD = ["model=moe-tiny", "model.moe.expert_bias_rate=0.01", "parallel.dp=2",
                "parallel/dp=powersgd", "parallel.dp_strategy.powersgd.warmup=2"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def train(run_dir: Path, *overrides: str, slow=False):
    """``slow``: True (``SLOW``) or the fault to inject."""
    fault = SLOW if slow is True else slow
    env = dict(os.environ, OMP_NUM_THREADS="1", **({"HYBRID_TEST_FAULT": fault} if fault else {}))
    done = subprocess.run([TRAIN, *COMMON, f"hydra.run.dir={run_dir}", *overrides],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return checked_records(run_dir), done.stderr


def saved_tensors(path: Path) -> dict:
    """Every model, optimizer and DP option tensor of checkpoint ``path``, whole (one
    process)."""
    metadata = read_metadata(path).state_dict_metadata
    state = {key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
             for key, item in metadata.items()
             if key.startswith(("model.", "optim.", "dp_option."))}
    with single_process():
        dcp.load(state, storage_reader=SafeReader(path), no_dist=True)
    return state


def moved_runs(tmp_path: Path, layout: list, fault: str, moves=("memory", "checkpoint")):
    """The static run, and a slowed dynamic run moving in memory and one moving through a
    checkpoint (``moves``), each checkpointing at step 6 (after the move); in the memory run
    a file named ``pp_balance`` stands where the checkpoint move writes, so writing there
    fails."""
    static, _ = train(tmp_path / "static", *layout)
    blocked = tmp_path / "memory" / "checkpoints"
    blocked.mkdir(parents=True)
    (blocked / "pp_balance").write_text("a memory move writes nothing here\n")
    runs = {}
    for move in moves:
        runs[move] = train(tmp_path / move, *layout, "parallel.pp_balance=dynamic",
                           f"parallel.pp_balance_move={move}", "checkpoint.every=6",
                           slow=fault)
    return static, runs


def check_moves(tmp_path: Path, static: list, runs: dict) -> tuple[list, dict]:
    """The dynamic runs moved layers and kept the static run's losses; with both moves,
    they agree bitwise (losses and the step-6 checkpoint, whatever split each chose).
    Returns the memory run's splits and (both moves) its step-6 checkpoint's tensors."""
    assert all("pp_split" not in r for r in static)
    for move, (records, said) in runs.items():
        splits = [r["pp_split"] for r in records]
        assert splits[0] == [4, 4] and splits[-1] != [4, 4] and sum(splits[-1]) == 8, \
            (move, splits)
        moved = [line for line in said.splitlines() if line.startswith("pp_balance: ")]
        assert moved and "layers per stage [4, 4] -> " in moved[0], said[-2000:]
        assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in static],
                                                             rel=1e-5)
    assert (tmp_path / "memory" / "checkpoints" / "pp_balance").is_file()
    if "checkpoint" not in runs:
        return [r["pp_split"] for r in runs["memory"][0]], None
    memory, checkpoint = runs["memory"][0], runs["checkpoint"][0]
    assert [r["loss"] for r in memory] == [r["loss"] for r in checkpoint]
    assert not (tmp_path / "checkpoint" / "checkpoints" / "pp_balance").exists()
    ours, theirs = (saved_tensors(tmp_path / move / "checkpoints" / "step_00000006")
                    for move in ("memory", "checkpoint"))
    assert sorted(ours) == sorted(theirs) and any(k.startswith("optim.") for k in ours)
    differ = [key for key in ours if not torch.equal(ours[key], theirs[key])]
    assert not differ, differ[:5]
    return [r["pp_split"] for r in memory], ours


def test_a_slow_stage_gives_up_layers_and_the_losses_stay(tmp_path):
    # the two moves agree bitwise in the other two tests (ZeRO-3 with TP; PowerSGD, MoE)
    static, runs = moved_runs(tmp_path, [], SLOW, moves=("memory",))
    splits, _ = check_moves(tmp_path, static, runs)
    assert splits[-1][1] < 4, splits  # the slowed stage 1 gave up layers

    # the step-6 checkpoint holds the split step 7 runs on: what a resume continues on
    # (``hybrid.balance.stages.resumed_plan``, tests/test_pp_balance.py)
    manifest = read_manifest(tmp_path / "memory" / "checkpoints" / "step_00000006")
    assert layer_counts([range(*blocks) for blocks in manifest["stages"]]) == splits[6]


def test_layers_move_in_memory_between_tp_shards_under_zero3(tmp_path):
    static, runs = moved_runs(tmp_path, DP_TP, SLOW_DP_TP)
    splits, _ = check_moves(tmp_path, static, runs)
    assert splits[-1][1] < 4, splits


def test_powersgd_state_and_expert_biases_move_with_their_layers(tmp_path):
    static, runs = moved_runs(tmp_path, MOE_POWERSGD, SLOW)  # rank 1: dp 1 of stage 0
    splits, saved = check_moves(tmp_path, static, runs)
    assert splits[-1][0] < 4, splits
    assert any(k.endswith(".q") for k in saved) and any(k.endswith(".mlp.expert_bias")
                                                        for k in saved)
