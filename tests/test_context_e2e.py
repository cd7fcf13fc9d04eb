"""Context parallelism through ``hybrid-train``: every layout with cp > 1 trains the 1-process
run's model (losses and gradient norms, rtol 1e-4), with its validation loss, and sends over its
context group exactly the bytes the cost model predicts (``checked_records``); a checkpoint
saved on cp2 x tp2 resumes on 1 process and on cp4 and continues the uninterrupted run."""

from pathlib import Path

import pytest

from hybrid.testing.accounting import train_checked

STEPS = 6
COMMON = ["model=tiny", "data=synthetic", f"train.steps={STEPS}", "train.global_batch=8",
          "train.micro_batch=2", "train.log_every=100", "train.timeline_step=0", "seed=5",
          "parallel=single", "eval.every=3", "eval.batches=2"]
LAYOUTS = {  # no plain cp2: cp2-zero1 runs the same ring (p2p) with dp2 beside it
    "cp4-recompute-full": ["parallel.cp=4", "model.recompute=full"],
    "cp2-allgather-selective": ["parallel.cp=2", "parallel.cp_comm=allgather",
                                "model.recompute=selective"],
    "cp2-tp2-sp": ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                   "checkpoint.every=3"],
    "cp2-pp2-1f1b-measured": ["parallel.cp=2", "parallel.pp=2", "parallel.partition=measured"],
    "cp2-pp2-dualpipev": ["parallel.cp=2", "parallel.pp=2", "parallel.vpp=2",
                          "parallel.schedule=dualpipev"],
    "dp2-cp2-tp2-zero2": ["parallel.dp=2", "parallel.cp=2", "parallel.tp=2", "parallel.zero=2"],
    "cp2-zero1": ["parallel.dp=2", "parallel.cp=2", "parallel.zero=1"],
}

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def run_train(run_dir: Path, *overrides: str) -> list[dict]:
    return train_checked([*COMMON, *overrides], run_dir)  # state and DP/CP bytes as planned


def by_step(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return run_train(tmp_path_factory.mktemp("one"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    done = {}

    def get(name: str) -> tuple[Path, list[dict]]:
        if name not in done:
            run_dir = tmp_path_factory.mktemp(name)
            done[name] = run_dir, run_train(run_dir, *LAYOUTS[name])
        return done[name]
    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_context_parallel_layout_equals_the_1_process_run(name, reference, runs):
    run_dir, records = runs(name)
    for key in ("loss", "grad_norm", "eval_loss"):
        assert by_step(records, key) == pytest.approx(by_step(reference, key), rel=1e-4), key
    assert sorted(by_step(records, "eval_loss")) == [3, 6]
    cp_bytes = [r["comm_bytes"]["cp"] for r in records]
    assert all(b > 0 for b in cp_bytes)  # the ring's traffic is counted, as its own axis
    assert {r["model_flops"] for r in records} == {reference[0]["model_flops"]}


@pytest.mark.parametrize("target", [[], ["parallel.cp=4"]], ids=["1-process", "cp4"])
def test_a_cp2_tp2_checkpoint_resumes_on_another_cp(target, runs, tmp_path):
    source, records = runs("cp2-tp2-sp")
    step_3 = source / "checkpoints" / "step_00000003"
    resumed = run_train(tmp_path, f"checkpoint.resume_from={step_3}", *target)
    assert sorted(by_step(resumed, "loss")) == [4, 5, 6]
    expected = {s: v for s, v in by_step(records, "loss").items() if s > 3}
    assert by_step(resumed, "loss") == pytest.approx(expected, rel=1e-4)
