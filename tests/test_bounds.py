"""Values beyond their bounds (``hybrid.planning.bounds``) are refused before anything is
built from them, in one line whose advice, applied, passes validation."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.planning.validate import config_problems, validate_config
from launch.commands.app import compose_train_config

BIN = Path(sys.executable).parent

BEYOND = [
    (["train.global_batch=1000000000000", "eval.every=0", "eval.at_end=false"],
     "train.global_batch=1,000,000,000,000 is beyond the bound of 16,777,216"),
    (["train.global_batch=4000000"], "= 1,000,000 micro-batches per step is beyond"),
    (["train.micro_batch=100000"], "train.micro_batch=100,000 is beyond"),
    (["train.micro_batch=100000", "parallel.pp=4", "model.layers=8"],
     "train.micro_batch=100,000 is beyond"),
    (["model.seq_len=100000000"], "model.seq_len=100,000,000 is beyond"),
    (["model.vocab=100000000"], "model.vocab=100,000,000 is beyond"),
    (["train.steps=1000000000"], "train.steps=1,000,000,000 is beyond"),
    (["train.steps=90000000", "train.global_batch=64"], "sequences is beyond the bound"),
    (["train.global_batch=2000000", "train.micro_batch=64"],
     "one batch is beyond it: turn evaluation off with eval.every=0 eval.at_end=false"),
    (["eval.batches=1000000000"], "choose eval.batches <= 65536"),
]


def advice(line: str) -> list[str]:
    """The settings a refusal's fix names, as overrides."""
    for pattern in (r"; e\.g\. (.+)$", r"turn evaluation off with ([^,;]+)"):
        found = re.search(pattern, line)
        if found:
            return found.group(1).split()
    found = re.search(r"choose (\S+) <= (\d+)$", line)
    assert found, line
    return [f"{found.group(1)}={found.group(2)}"]


@pytest.mark.parametrize("overrides, needle", BEYOND, ids=[" ".join(b[0]) for b in BEYOND])
def test_a_value_beyond_its_bound_is_refused_with_advice_that_passes(overrides, needle):
    problems = config_problems(compose_train_config(overrides))
    assert problems and needle in problems[0] and "\n" not in problems[0], problems
    fixed = compose_train_config(overrides + advice(problems[0]))
    validate_config(fixed)  # raises with the next problem if the advice is not valid


def test_the_suggested_micro_batch_keeps_the_global_batch():
    problem = config_problems(compose_train_config(["train.micro_batch=100000"]))[0]
    assert problem.endswith("e.g. train.micro_batch=4"), problem  # 16 / (dp 2 x pp 2)


@pytest.mark.parametrize("command", ["hybrid-train", "hybrid-plan"])
def test_a_huge_global_batch_is_refused_at_once_by_the_commands(command, tmp_path):
    done = subprocess.run([str(BIN / command), "train.global_batch=1000000000000",
                           "eval.every=0", "eval.at_end=false", f"hydra.run.dir={tmp_path}/r"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert any("train.global_batch=1,000,000,000,000 is beyond" in line for line in lines), lines
    assert "Traceback" not in done.stderr
