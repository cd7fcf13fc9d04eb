"""Tensor-parallel GPT against the 1-process model, on gloo processes.

One 4-process job runs every parity case (each rank also builds the 1-process reference from
the same seed and batch), checks block independence and tied-head copies, and trains a few
AdamW steps; the tests below read its results. A 2-process job checks that a bad batch on one
rank stops both ranks promptly.
"""

import time
from dataclasses import dataclass, replace

import pytest
import torch

from hybrid.planning.config import ModelConfig
from hybrid.planning.cost.sizes import activation_bytes_per_layer, head_activation_bytes
from hybrid.groups import ParallelGroups
from hybrid.planning.layout import Layout, LayoutError
from hybrid.model import (
    GPT, ModelInputError, allreduce_sequence_parallel_grads, build_blocks,
    gather_tp_param, num_blocks, validate_batch,
)
from hybrid.model.activations import SavedTensors
from hybrid.model.gpt import lm_loss
from hybrid.testing import spawn
from hybrid.planning.validate import check_model_shape

pytestmark = pytest.mark.timeout(180)

TINY = dict(layers=2, hidden=32, heads=4, vocab=120, vocab_pad_multiple=64, seq_len=16)
SEED, BATCH, SEQ = 7, 2, 16


@dataclass(frozen=True)
class Case:
    tp: int
    sp: bool = False
    tie: bool = False
    recompute: str = "none"
    bf16: bool = False


CASES = {
    "tp1": Case(1), "tp2": Case(2), "tp4": Case(4),
    "tp2-sp": Case(2, sp=True), "tp4-sp": Case(4, sp=True),
    "tp2-tied": Case(2, tie=True), "tp4-sp-tied": Case(4, sp=True, tie=True),
    "tp2-recompute": Case(2, recompute="full"),
    "tp4-sp-tied-recompute": Case(4, sp=True, tie=True, recompute="full"),
    "tp1-selective": Case(1, recompute="selective"),
    "tp2-sp-selective": Case(2, sp=True, recompute="selective"),
    "tp2-bf16": Case(2, bf16=True), "tp4-sp-tied-bf16": Case(4, sp=True, tie=True, bf16=True),
    "tp2-sp-selective-bf16": Case(2, sp=True, recompute="selective", bf16=True),
}
FP32_CASES = [name for name, case in CASES.items() if not case.bf16]
BF16_CASES = [name for name, case in CASES.items() if case.bf16]


def _cfg(case: Case) -> ModelConfig:
    return ModelConfig(**TINY, tie_embeddings=case.tie, recompute=case.recompute)


def _batch(step: int = 0):
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, TINY["vocab"], (BATCH, SEQ), generator=gen)
    return tokens, torch.randint(0, TINY["vocab"], (BATCH, SEQ), generator=gen)


def _loss_and_backward(model: GPT, case: Case, tokens, labels) -> float:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.bf16):
        loss = model(tokens, labels)
    loss.backward()  # outside autocast, as a training loop does
    if model.sequence_parallel:
        allreduce_sequence_parallel_grads(model.blocks, model.groups.tensor)
    return loss.item()


def _compare(gathered: torch.Tensor, reference: torch.Tensor) -> dict:
    diff = (gathered.double() - reference.double())
    return {"max_rel": (diff.abs().max() / reference.double().abs().max().clamp_min(1e-30)).item(),
            "norm_rel": (diff.norm() / reference.double().norm().clamp_min(1e-30)).item()}


def _one_case(case: Case, reference_groups, groups) -> dict:
    """The parallel model with the case's recompute against the 1-process model without."""
    cfg = _cfg(case)
    reference = GPT(replace(cfg, recompute="none"), reference_groups, seed=SEED)
    parallel = GPT(cfg, groups, seed=SEED, sequence_parallel=case.sp)
    ref_params = dict(reference.named_parameters())
    init_mismatch = [name for name, p in parallel.named_parameters()
                     if not torch.equal(gather_tp_param(p.detach(), p, groups), ref_params[name])]
    tokens, labels = _batch()
    saved = _saved_bytes_per_block(parallel, case, tokens, labels)
    losses = (_loss_and_backward(parallel, case, tokens, labels),
              _loss_and_backward(reference, case, tokens, labels))
    grads = {name: _compare(gather_tp_param(p.grad, p, groups), ref_params[name].grad)
             for name, p in parallel.named_parameters()}
    return {"init_mismatch": init_mismatch, "losses": losses, "grads": grads, "saved": saved,
            "names": sorted(ref_params) == sorted(dict(parallel.named_parameters()))}


def _saved_bytes_per_block(model: GPT, case: Case, tokens, labels) -> dict:
    """What each transformer layer, and the head with the loss, keeps for backward (measured
    with saved-tensor hooks) beside what the cost model says."""
    out = {"layer": [], "head": None}
    hidden = tokens
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.bf16):
        for block in model.blocks:
            with SavedTensors(block.parameters()) as saved:
                hidden = block(hidden)
                if block is model.blocks[-1]:
                    lm_loss(hidden, labels, model.groups, model.cfg.vocab)
            if 1 <= block.block_id <= TINY["layers"]:
                out["layer"].append(saved.total)
            elif block.block_id == TINY["layers"] + 1:
                out["head"] = saved.total
    precision = "bf16" if case.bf16 else "fp32"
    cfg, sp = _cfg(case), case.sp and case.tp > 1
    out["predicted_layer"] = activation_bytes_per_layer(cfg, BATCH, case.tp, sp, precision,
                                                        case.recompute)
    out["predicted_head"] = head_activation_bytes(cfg, BATCH, case.tp, sp, precision)
    return out


def _block_independence(groups) -> dict:
    """A block's weights must not depend on which other blocks this rank builds."""
    out = {}
    for tie in (False, True):
        cfg = ModelConfig(**TINY, tie_embeddings=tie)
        full = build_blocks(cfg, groups, seed=SEED)
        alone = build_blocks(cfg, groups, seed=SEED, block_ids=[2, num_blocks(cfg) - 1])
        same = [torch.equal(a, b) for a, b in zip(full[2].parameters(), alone[0].parameters())]
        out[f"layer_alone_tie={tie}"] = all(same) and len(same) > 0
        if tie:
            head, embedding_weight = alone[1], full[0].word_embeddings.weight
            copy = head.word_embeddings_weight
            out["tied_copy_equal"] = torch.equal(copy, embedding_weight)
            out["tied_copy_is_own"] = copy is not embedding_weight
            out["tied_marked"] = (copy.spec == embedding_weight.spec and copy.spec.tied
                                  and copy.spec.name == "embedding.word_embeddings.weight")
            out["tied_shared_in_full"] = full[-1].word_embeddings_weight is embedding_weight
    return out


def _replicas_identical(model: GPT) -> list[str]:
    """Names of TP-replicated parameters that differ (bitwise) from TP rank 0's copy."""
    tp = model.groups.tensor
    differ = []
    for name, p in model.named_parameters():
        if p.spec.tp_dim is not None:
            continue
        copies = [torch.empty_like(p) for _ in range(tp.size())]
        tp.all_gather(copies, p.detach())
        if not all(torch.equal(c, copies[0]) for c in copies):
            differ.append(name)
    return differ


def _train_steps(case: Case, reference_groups, groups, steps: int = 3) -> dict:
    cfg = _cfg(case)
    models = [GPT(cfg, groups, seed=SEED, sequence_parallel=case.sp),
              GPT(cfg, reference_groups, seed=SEED)]
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    losses, differ = [], []
    for step in range(steps):
        tokens, labels = _batch(step + 1)
        losses.append([_loss_and_backward(m, case, tokens, labels) for m in models])
        for optim in optims:
            optim.step()
            optim.zero_grad()
        differ += [f"step {step}: {name}" for name in _replicas_identical(models[0])]
    return {"losses": losses, "differ": differ}


def _tp_job(rank, world):
    reference = ParallelGroups.create(Layout())  # a 1-rank model on every process
    groups = {tp: ParallelGroups.create(Layout(tp=tp)) for tp in (1, 2, 4)}
    results = {name: _one_case(case, reference, groups[case.tp]) for name, case in CASES.items()}
    results["independence"] = _block_independence(groups[2])
    results["train"] = {name: _train_steps(CASES[name], reference, groups[CASES[name].tp])
                        for name in ("tp2", "tp4-sp")}
    return results


@pytest.fixture(scope="module")
def tp_results():
    return spawn(_tp_job, 4, timeout=150)


@pytest.mark.parametrize("name", list(CASES))
def test_initial_weights_are_bitwise_slices_of_the_reference(tp_results, name):
    for rank, results in enumerate(tp_results):
        assert results[name]["names"], "parameter names differ from the reference model"
        assert results[name]["init_mismatch"] == [], (rank, name)


@pytest.mark.parametrize("name", FP32_CASES)
def test_fp32_loss_and_every_gradient_match_the_reference(tp_results, name):
    for rank, results in enumerate(tp_results):
        parallel, reference = results[name]["losses"]
        assert parallel == pytest.approx(reference, rel=1e-5), (rank, name)
        bad = {p: e for p, e in results[name]["grads"].items() if e["max_rel"] > 1e-5}
        assert not bad, (rank, name, bad)


# bf16 rounds every matmul output to 8 significant bits (unit roundoff 2**-9 ~ 2e-3). The
# parallel model rounds row-parallel partial sums before reducing them, the reference rounds
# the full sum once, so the two differ by a few roundoffs per element, which averages down
# in the loss (a mean over tokens) and in gradient norms (sums over tokens).
BF16_LOSS_RTOL, BF16_GRAD_NORM_RTOL = 5e-3, 3e-2


@pytest.mark.parametrize("name", BF16_CASES)
def test_bf16_autocast_matches_the_reference_under_the_same_autocast(tp_results, name):
    for rank, results in enumerate(tp_results):
        parallel, reference = results[name]["losses"]
        assert parallel == pytest.approx(reference, rel=BF16_LOSS_RTOL), (rank, name)
        fp32_twin = name.replace("-bf16", "")
        assert reference != results[fp32_twin]["losses"][1], "autocast had no effect"
        bad = {p: e for p, e in results[name]["grads"].items()
               if e["norm_rel"] > BF16_GRAD_NORM_RTOL}
        assert not bad, (rank, name, bad)


@pytest.mark.parametrize("name", list(CASES))
def test_activation_bytes_are_the_cost_models_exactly(tp_results, name):
    """Every layer keeps for backward exactly what ``activation_bytes_per_layer`` says, by
    recompute mode, sequence parallelism, TP size and precision; the head what
    ``head_activation_bytes`` says (with tied embeddings the head's shared weight is the
    embedding's parameter, left out like any other)."""
    for results in tp_results:
        saved = results[name]["saved"]
        assert saved["layer"] == [saved["predicted_layer"]] * TINY["layers"], name
        assert saved["head"] == saved["predicted_head"], name


def test_blocks_are_initialised_independently_of_the_other_blocks_built(tp_results):
    for results in tp_results:
        assert all(results["independence"].values()), results["independence"]


@pytest.mark.parametrize("name", ["tp2", "tp4-sp"])
def test_replicated_params_stay_bitwise_identical_over_adamw_steps(tp_results, name):
    for rank, results in enumerate(tp_results):
        train = results["train"][name]
        assert train["differ"] == [], (rank, train["differ"])
        for parallel, reference in train["losses"]:
            assert parallel == pytest.approx(reference, rel=1e-5), (rank, train["losses"])


def _bad_batch_on_rank_one(rank, world):
    groups = ParallelGroups.create(Layout(tp=2))
    model = GPT(ModelConfig(**TINY), groups, seed=SEED)
    tokens, labels = _batch()
    if rank == 1:
        tokens = tokens.clone()
        tokens[0, 3] = TINY["vocab"] + 5
    start = time.monotonic()
    try:
        model(tokens, labels)
        message = None
    except ModelInputError as err:
        message = str(err)
    elapsed = time.monotonic() - start
    # Neither rank is stuck inside a collective: both go on to a good step together.
    good_loss = model(*_batch()).item()
    return message, elapsed, good_loss


def test_bad_batch_on_one_rank_stops_every_rank_promptly():
    (msg0, t0, loss0), (msg1, t1, loss1) = spawn(_bad_batch_on_rank_one, 2, timeout=60)
    assert "model.vocab=120" in msg1 and "125" in msg1
    assert "rank 1" in msg0
    assert max(t0, t1) < 10
    assert loss0 == loss1


@pytest.mark.parametrize("tokens, match", [
    (torch.full((2, 16), 120), r"ids in \[120, 120\] but model.vocab=120"),
    (torch.full((2, 16), -1), r"ids in \[-1, -1\]"),
    (torch.zeros(2, 17, dtype=torch.int64), "exceeds model.seq_len=16"),
    (torch.zeros(2, 16, dtype=torch.int32), "must be int64"),
    (torch.zeros(2, 16, dtype=torch.float32), "must be int64"),
    (torch.zeros(16, dtype=torch.int64), r"must be \[batch, seq\]"),
])
def test_validate_batch_names_the_problem_in_one_line(tokens, match):
    labels = torch.zeros(tokens.shape, dtype=torch.int64)
    with pytest.raises(ModelInputError, match=match) as err:
        validate_batch(tokens, labels, ModelConfig(**TINY))
    assert "\n" not in str(err.value)


def test_validate_batch_checks_sequence_shards_and_labels():
    cfg, tokens = ModelConfig(**TINY), torch.zeros(2, 6, dtype=torch.int64)
    with pytest.raises(ModelInputError, match="not a multiple of tp=4"):
        validate_batch(tokens, tokens, cfg, sequence_shards=4)
    with pytest.raises(ModelInputError, match="labels hold ids"):
        validate_batch(tokens, tokens + 500, cfg)
    validate_batch(tokens, tokens, cfg, sequence_shards=2)


def test_tp_that_does_not_divide_the_model_is_a_layout_error():
    with pytest.raises(LayoutError, match=r"parallel.tp=3 does not divide model.heads=4"):
        check_model_shape(ModelConfig(**TINY), 3)
