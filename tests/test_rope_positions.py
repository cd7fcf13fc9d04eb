"""A Llama 3 preset without rope scaling, asked for more positions than it was trained at, is
warned of in one line naming ``model.rope_scaling=llama3``, whose advice is itself valid
(fast, in-process); through ``hybrid-train`` the line comes before a run that goes (slow)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.planning.validate import config_warnings, validate_config
from launch.commands.app import compose_train_config

ROPE = "model.rope_scaling=llama3"


def rope_warnings(overrides: list[str]) -> list[str]:
    return [w for w in config_warnings(compose_train_config(overrides)) if ROPE in w]


@pytest.mark.parametrize("overrides", [
    ["model=llama3.2-1b", "model.rope_scaling=none", "model.seq_len=131072"],
    ["model=llama3-8b", "model.seq_len=131072"],
    ["model=llama3-70b", "model.seq_len=16384"],
])
def test_positions_past_the_trained_ones_without_scaling_are_warned_of(overrides):
    warned = rope_warnings(overrides)
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert "is past the 8192 positions" in warned[0], warned
    advice = re.search(r"set (model\.rope_scaling=\S+ model\.rope_factor=\S+)", warned[0])
    fixed = overrides + advice.group(1).split()
    assert rope_warnings(fixed) == []
    validate_config(compose_train_config(fixed))  # the advice is itself a valid setting


@pytest.mark.parametrize("overrides", [
    ["model=llama3.2-1b", "model.seq_len=131072"],  # the preset carries llama3 scaling
    ["model=llama3-8b"],
    ["model=llama-tiny", "model.seq_len=16384"],  # no published model to match
    ["model=gpt2-124m"],
])
def test_no_warning_where_the_positions_are_reached_or_nothing_is_published(overrides):
    assert rope_warnings(overrides) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hybrid_train_prints_the_warning_once_and_trains(tmp_path):
    shrunk = ["model=llama3-8b", "model.layers=2", "model.hidden=64", "model.heads=4",
              "model.kv_heads=2", "model.ffn_hidden=128", "model.vocab=256",
              "model.vocab_pad_multiple=1", "model.rope_original_positions=16",
              "model.seq_len=32", "data=synthetic", "parallel=single", "train.steps=1",
              "train.global_batch=1", "train.micro_batch=1", "optim.warmup_steps=1",
              "train.timeline_step=0", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run([str(Path(sys.executable).parent / "hybrid-train"), *shrunk],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if ROPE in line]
    assert warned == [line for line in done.stderr.splitlines() if line.startswith("warning")]
    assert len(warned) == 1 and warned[0].startswith(
        "warning: model.seq_len=32 is past the 16 positions model=llama3-8b"), warned
