"""Validation loss through ``hybrid-train`` on every kind of layout: each equals the 1-process
run's (rtol 1e-5), and evaluating changes no training number (bitwise)."""

from pathlib import Path

import pytest

from hybrid.testing.accounting import train_checked

STEPS = 5
COMMON = ["model=tiny", "data=synthetic", "model.layers=8", f"train.steps={STEPS}",
          "train.global_batch=8", "train.micro_batch=2", "train.log_every=100",
          "train.timeline_step=0", "seed=3"]
EVAL = ["eval.every=2", "eval.batches=2", "eval.at_end=true"]
BASE = "2x2x2-1f1b"  # the base layout: no parallel override
LAYOUTS = {
    BASE: [],
    "pp2-1f1b": ["parallel=single", "parallel.pp=2"],
    "pp4-interleaved-vpp2": ["parallel=single", "parallel.pp=4", "parallel.vpp=2",
                             "parallel.schedule=interleaved-1f1b"],
    "tp2-sp": ["parallel=single", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "dp2-zero2": ["parallel=single", "parallel.dp=2", "parallel.zero=2"],
    # evaluation runs the forwards of DualPipeV's lists (its composites' forward parts)
    "pp2-dualpipev": ["parallel=single", "parallel.pp=2", "parallel.vpp=2",
                      "parallel.schedule=dualpipev"],
}

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def run_train(run_dir: Path, *overrides: str) -> list[dict]:
    return train_checked([*COMMON, *overrides], run_dir)  # state and DP/CP bytes as planned


def evals(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    records = run_train(tmp_path_factory.mktemp("one"), "parallel=single", *EVAL)
    assert sorted(evals(records)) == [2, 4, 5]  # every 2nd step, and the last
    record = next(r for r in records if r["step"] == 2)
    assert record["eval_tokens"] == 2 * 8 * 32 and record["eval_s"] > 0
    assert record["eval_ppl"] == pytest.approx(2.718281828 ** record["eval_loss"])
    return records


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> list[dict]:
    """The base layout with evaluation on: one run that both the layout comparison and the
    on/off comparison read (the same job)."""
    return run_train(tmp_path_factory.mktemp("evaluated"), *LAYOUTS[BASE], *EVAL)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_eval_loss_equals_the_1_process_run(name, reference, request, tmp_path):
    records = (request.getfixturevalue("evaluated") if name == BASE
               else run_train(tmp_path, *LAYOUTS[name], *EVAL))
    expected = evals(reference)
    assert sorted(evals(records)) == sorted(expected)
    assert evals(records) == pytest.approx(expected, rel=1e-5)
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference],
                                                         rel=1e-4)
    # MFU's model FLOPs are the model's, whatever the layout (no parallel axis inflates them)
    assert {r["model_flops"] for r in records} == {reference[0]["model_flops"]}
    assert all(0 < r["mfu"] <= r["hfu"] for r in records)


def test_evaluating_changes_no_training_number(evaluated, tmp_path):
    on, off = evaluated, run_train(tmp_path, *LAYOUTS[BASE])
    keys = ("loss", "grad_norm", "lr", "comm_bytes", "comm_calls")
    assert [{k: r[k] for k in keys} for r in on] == [{k: r[k] for k in keys} for r in off]
    assert not evals(off)
