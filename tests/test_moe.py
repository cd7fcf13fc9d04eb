"""A tiny mixture-of-experts model through ``hybrid-train`` (docs/moe.md): its losses with the
aux loss and the aux-loss-free expert bias on equal to the 1-process run's, its gradient
norms too (clipping on: a wrong gradient scale changes the losses), and its final expert
biases too, on dense and expert-parallel layouts (rtol 1e-4), one with full recompute
(its MoE figures each step the 1-process run's: the recomputed forward counts nothing again),
and a checkpoint resumed on another layout. The layer on its own is test_moe_layer's."""

import math

import pytest
import torch

from hybrid.testing.accounting import checked_records
from test_llama import assert_same_losses, preset, run_train

MOE = ["model=moe-tiny", "model.moe.expert_bias_rate=0.01", "train.grad_clip=0.5"]
"""moe-tiny with the aux-loss-free expert bias on too (every run below, the reference's as
well): each layout's losses and final biases are the 1-process run's. Clipped at 0.5, below
every step's norm (0.62-0.69): AdamW is blind to a gradient's scale, clipping is not, so an
expert gradient ep times too large shows in the losses as well as in ``grad_norm``."""



LAYOUTS = {
    # small buckets: dense and expert buckets apart, each padded for its ZeRO shards
    "dp2-zero1": ["parallel=single", "parallel.dp=2", "parallel.zero=1",
                  "parallel.bucket_mb=0.02"],
    # full recompute: the backward re-runs each layer's forward, routing its tokens again;
    # with sequence parallelism, the router sees each TP rank's share of the sequence
    "tp2-sp-recompute": ["parallel=single", "parallel.tp=2", "parallel.sequence_parallel=true",
                         "model.recompute=full"],
    # expert parallelism: experts spread over ranks carved out of dp x cp
    "dp2-ep2-pp2-1f1b": ["parallel=single", "parallel.dp=2", "parallel.ep=2", "parallel.pp=2",
                         "parallel.schedule=1f1b"],
    "dp4-ep4-zero2": ["parallel=single", "parallel.dp=4", "parallel.ep=4", "parallel.zero=2",
                      "parallel.bucket_mb=0.02"],
    "dp2-cp2-ep2": ["parallel=single", "parallel.dp=2", "parallel.cp=2", "parallel.ep=2"],
    # every DP strategy on the expert placement: ZeRO-3 gathers the experts' weights over
    # their expert-DP group; dynamic shares give an expert group's replicas one share
    "dp2-ep2-zero3": ["parallel=single", "parallel.dp=2", "parallel.ep=2", "parallel.zero=3",
                      "parallel.bucket_mb=0.02"],
    "dp2-ep2-dynamic": ["parallel=single", "parallel.dp=2", "parallel.ep=2",
                        "parallel.dp_balance=dynamic", "parallel.dp_balance_every=2"],
    # all four axes on 8 ranks: experts over dp, their weights TP-split, two stages
    "dp2-ep2-tp2-pp2": ["parallel=single", "parallel.dp=2", "parallel.ep=2", "parallel.tp=2",
                        "parallel.pp=2", "parallel.schedule=1f1b"],
}
"""Each run one launch (about 15 s of two cores): what another run covers is not run twice
(plain dp2 and dp2 ep2 are inside these; pp2 alone in the DualPipeV test below)."""
RESUMED = {"dp2-ep2-tp2": ["parallel=single", "parallel.dp=2", "parallel.ep=2", "parallel.tp=2"],
           "dp2": ["parallel=single", "parallel.dp=2"],
           "dp4-ep4-zero2": LAYOUTS["dp4-ep4-zero2"]}
"""The resume test's layouts: saved on the first, resumed on the others."""
WEIGHTS_CHECKED = ("dp2-ep2-zero3", "dp2-ep2-dynamic", "dp4-ep4-zero2", "dp2-ep2-tp2-pp2")
"""The layouts whose final weights (every step's gradients went into them) are compared with
the 1-process run's too: each DP strategy that issue 53 opened to expert weights, and the four
axes together."""


LAST = ["checkpoint.every=6"]
"""A checkpoint at the last step (test_llama's 6): the run's final expert biases."""


@pytest.fixture(scope="module")
def moe_reference_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe-reference")
    done = run_train(run_dir, *MOE, "parallel=single", *LAST)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def moe_reference_run(moe_reference_dir):
    run_dir = moe_reference_dir
    biases = final_biases(run_dir)
    assert len(biases) == preset("moe-tiny").layers
    assert any(bias.abs().max() > 0 for bias in biases.values())  # they moved
    records = checked_records(run_dir)
    norms = [r["grad_norm"] for r in records]
    assert all(norm > 0.5 for norm in norms)  # every step clipped
    return [r["loss"] for r in records], biases, [r["moe"] for r in records], norms


@pytest.fixture(scope="module")
def moe_reference(moe_reference_run):
    return moe_reference_run[0]


def final_biases(run_dir) -> dict:
    """The expert biases of a run's step-6 checkpoint, by global name."""
    from hybrid.checkpoint.weights import read_model_weights
    from hybrid.planning.models.moe import is_expert_bias

    weights = read_model_weights(run_dir / "checkpoints" / "step_00000006")
    return {name: t for name, t in weights.items() if is_expert_bias(name)}


def assert_same_biases(run_dir, reference: dict) -> None:
    biases = final_biases(run_dir)
    assert sorted(biases) == sorted(reference)
    for name, bias in biases.items():
        torch.testing.assert_close(bias, reference[name], rtol=1e-4, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_losses_with_the_aux_loss_equal_the_1_process_run(name, moe_reference_run,
                                                              moe_reference_dir, tmp_path):
    done = run_train(tmp_path, *MOE, *LAYOUTS[name], *LAST)
    assert done.returncode == 0, done.stderr[-3000:]
    # checked: every rank's state bytes, and DP bytes (the experts' buckets over their own
    # expert data-parallel group, the dense ones over dp x cp, the expert biases' counts over
    # dp x cp) as predicted, every step
    records = checked_records(tmp_path)
    assert_same_losses([r["loss"] for r in records], moe_reference_run[0])
    assert_same_norms([r["grad_norm"] for r in records], moe_reference_run[3])
    assert_same_biases(tmp_path, moe_reference_run[1])  # every stage's layers, on any layout
    if name in WEIGHTS_CHECKED:
        assert_same_weights(final_weights(tmp_path), final_weights(moe_reference_dir))
    if "-ep" in name:
        assert all(r["comm_bytes"]["ep"] > 0 for r in records)  # tokens travelled
        _assert_expert_groups(tmp_path)
    _assert_moe_metrics(records, name, moe_reference_run[2])


def assert_same_norms(norms: list[float], reference: list[float]) -> None:
    """The global gradient norm of every step, the 1-process run's: each expert's gradient is
    the 1-process mean's (not ep times it), counted once."""
    assert len(norms) == len(reference)
    assert norms == pytest.approx(reference, rel=1e-5)


def _assert_moe_metrics(records, name, reference):
    """Rank 0's MoE layers' figures in every record: dropless, so every routed slot kept,
    once (a full recompute routes them again); where rank 0 routes every token of every layer
    (TP only), each step's slots per expert and mean aux loss are the 1-process run's
    (``reference``: its records' ``moe``)."""
    cfg = preset("moe-tiny")
    layers = cfg.layers // 2 if "pp2" in name else cfg.layers
    cp = 2 if "cp2" in name else 1
    dp = 4 if "dp4" in name else 2 if ("dp2" in name) else 1
    microbatches = 8 // 2 // dp
    slots = layers * microbatches * 2 * cfg.seq_len // cp * cfg.moe.topk
    for record in records:
        moe = record["moe"]
        assert sum(moe["tokens_per_expert"]) == slots and moe["dropped"] == 0, (moe, slots)
        assert moe["load_max_over_mean"] >= 1.0 and moe["aux_loss"] > 0
    if name.startswith("tp2"):
        moe = [r["moe"] for r in records]
        assert [m["tokens_per_expert"] for m in moe] == \
            [m["tokens_per_expert"] for m in reference]
        assert [m["aux_loss"] for m in moe] == \
            pytest.approx([m["aux_loss"] for m in reference], rel=1e-4)


def _assert_expert_groups(run_dir):
    """The plan's expert groups are megatron's (``hybrid.planning.expert_grid``) and the
    experts' gradient group is a strict part of the dense one."""
    import json

    from hybrid.planning.expert_grid import expert_groups
    from hybrid.planning.plan_file import load_plan

    plan = load_plan(run_dir)
    layout, saved = plan.layout, json.loads((run_dir / "plan.json").read_text())["groups"]
    assert saved["expert"] == expert_groups(layout, layout.ep, "ep")
    assert saved["expert_gradient"] == expert_groups(layout, layout.ep, "edp")
    assert layout.role_size("expert_gradient") * layout.ep == layout.role_size("gradient")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pipelined_layout_at_micro_batch_1_equals_the_1_process_run_at_micro_batch_1(
        moe_reference_run, tmp_path):
    """The aux loss is computed per micro-batch (docs/moe.md), so the micro-batch is part
    of an MoE run's maths: a layout equals the 1-process run at its own
    ``train.micro_batch``. pp2 DualPipeV (2pp micro-batches at least: 8 of 1 here) against
    the 1-process run at micro_batch=1: the same losses and gradient norms every step, and
    the same final weights and expert biases (every step's gradients went into them). The
    micro_batch=2 reference's first step, on the same weights, has another aux loss (1.00158
    against 1.00282 at micro_batch=1); at moe-tiny's coefficient 0.01 that moves the losses
    by about 2e-6 in 6 steps, below the tolerance, so the aux loss is what tells them apart."""
    runs = {"single": ["parallel=single"],
            "pp2-dualpipev": ["parallel=single", "parallel.pp=2", "parallel.vpp=2",
                              "parallel.schedule=dualpipev"]}
    records = {}
    for name, layout in runs.items():
        done = run_train(tmp_path / name, *MOE, *layout, "train.micro_batch=1", *LAST)
        assert done.returncode == 0, done.stderr[-3000:]
        records[name] = checked_records(tmp_path / name)
    single, piped = records["single"], records["pp2-dualpipev"]
    assert_same_losses([r["loss"] for r in piped], [r["loss"] for r in single])
    assert [r["grad_norm"] for r in piped] == pytest.approx([r["grad_norm"] for r in single],
                                                           rel=1e-4)
    assert_same_weights(*(final_weights(tmp_path / name) for name in runs))
    reference_losses, _, reference_moe, _ = moe_reference_run
    assert single[0]["loss"] == pytest.approx(reference_losses[0], rel=1e-5)
    assert single[0]["moe"]["aux_loss"] != pytest.approx(reference_moe[0]["aux_loss"], rel=1e-4)


def assert_same_weights(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, weight in ours.items():
        torch.testing.assert_close(weight, theirs[name], rtol=1e-4, atol=1e-6, msg=name)


def final_weights(run_dir) -> dict:
    """Every weight and buffer of a run's step-6 checkpoint, by global name."""
    from hybrid.checkpoint.weights import read_model_weights

    return read_model_weights(run_dir / "checkpoints" / "step_00000006")


def test_the_aux_loss_changes_the_training(moe_reference, tmp_path):
    done = run_train(tmp_path, *MOE, "parallel=single", "model.moe.aux_loss=0")
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [r["loss"] for r in checked_records(tmp_path)]
    assert losses[0] == moe_reference[0] and losses[-1] != moe_reference[-1]
    assert all(math.isfinite(x) for x in losses)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_checkpoint_saved_on_ep2_resumes_on_ep1_and_ep4_with_the_same_losses(
        moe_reference_run, tmp_path):
    """Saved on dp2 ep2 x tp2 with sequence parallelism (experts split over ep and TP),
    resumed on dp2 (ep1: every expert on every rank) and on dp4 ep4 (one expert a rank): the
    checkpoint holds every expert by its global index, and the expert biases, so the resumed
    runs end with the uninterrupted run's biases too."""
    moe_reference, reference_biases, *_ = moe_reference_run
    source = tmp_path / "source"
    done = run_train(source, *MOE, *RESUMED["dp2-ep2-tp2"], "parallel.sequence_parallel=true",
                     "checkpoint.every=3")
    assert done.returncode == 0, done.stderr[-3000:]
    step = source / "checkpoints" / "step_00000003"
    for name in ("dp2", "dp4-ep4-zero2"):
        target = tmp_path / name
        done = run_train(target, *MOE, *RESUMED[name], f"checkpoint.resume_from={step}",
                         "checkpoint.every=3")
        assert done.returncode == 0, done.stderr[-3000:]
        resumed = {r["step"]: r["loss"] for r in checked_records(target)}
        assert sorted(resumed) == [4, 5, 6]
        assert list(resumed.values()) == pytest.approx(moe_reference[3:], rel=1e-4)
        assert_same_biases(target, reference_biases)
