"""Llama's blocks under tensor parallelism against the 1-process model, in one spawned job:
weights are bitwise slices, losses and every gradient match (fp32), and each layer and the
head keep for backward exactly the bytes the cost model says (saved-tensor hooks)."""

from dataclasses import dataclass, replace

import pytest
import torch

from hybrid.groups import ParallelGroups
from hybrid.model import GPT, allreduce_sequence_parallel_grads, gather_tp_param
from hybrid.model.activations import SavedTensors
from hybrid.model.gpt import lm_loss
from hybrid.model.llama import rotary_tables, rotate
from hybrid.planning.config import ModelConfig
from hybrid.planning.cost.sizes import activation_bytes_per_layer, head_activation_bytes
from hybrid.planning.layout import Layout
from hybrid.testing import spawn

pytestmark = pytest.mark.timeout(180)

TINY = dict(family="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48,
            vocab=120, vocab_pad_multiple=64, seq_len=16)
SEED, BATCH, SEQ = 7, 2, 16


@dataclass(frozen=True)
class Case:
    tp: int
    sp: bool = False
    tie: bool = False
    recompute: str = "none"
    kv: int = 2
    bf16: bool = False


CASES = {
    "tp1": Case(1), "tp1-mqa": Case(1, kv=1), "tp1-mha": Case(1, kv=4),
    "tp2": Case(2), "tp2-sp": Case(2, sp=True), "tp2-sp-tied": Case(2, sp=True, tie=True),
    "tp2-mha-sp": Case(2, sp=True, kv=4), "tp2-recompute": Case(2, recompute="full"),
    "tp2-sp-selective": Case(2, sp=True, recompute="selective"),
    "tp2-sp-bf16": Case(2, sp=True, bf16=True),
}
FP32_CASES = [name for name, case in CASES.items() if not case.bf16]


def _cfg(case: Case) -> ModelConfig:
    return ModelConfig(**{**TINY, "kv_heads": case.kv}, tie_embeddings=case.tie,
                       recompute=case.recompute)


def _batch():
    gen = torch.Generator().manual_seed(1000)
    tokens = torch.randint(0, TINY["vocab"], (BATCH, SEQ), generator=gen)
    return tokens, torch.randint(0, TINY["vocab"], (BATCH, SEQ), generator=gen)


def _loss_and_backward(model: GPT, case: Case, tokens, labels) -> float:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.bf16):
        loss = model(tokens, labels)
    loss.backward()
    if model.sequence_parallel:
        allreduce_sequence_parallel_grads(model.blocks, model.groups.tensor)
    return loss.item()


def _saved(model: GPT, case: Case, tokens, labels) -> dict:
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
    precision, sp = ("bf16" if case.bf16 else "fp32"), case.sp and case.tp > 1
    out["predicted_layer"] = activation_bytes_per_layer(_cfg(case), BATCH, case.tp, sp,
                                                        precision, case.recompute)
    out["predicted_head"] = head_activation_bytes(_cfg(case), BATCH, case.tp, sp, precision)
    return out


def _one_case(case: Case, reference_groups, groups) -> dict:
    cfg = _cfg(case)
    reference = GPT(replace(cfg, recompute="none"), reference_groups, seed=SEED)
    parallel = GPT(cfg, groups, seed=SEED, sequence_parallel=case.sp)
    ref_params = dict(reference.named_parameters())
    init_mismatch = [name for name, p in parallel.named_parameters()
                     if not torch.equal(gather_tp_param(p.detach(), p, groups), ref_params[name])]
    tokens, labels = _batch()
    saved = _saved(parallel, case, tokens, labels)
    losses = (_loss_and_backward(parallel, case, tokens, labels),
              _loss_and_backward(reference, case, tokens, labels))
    grads = {}
    for name, p in parallel.named_parameters():
        diff = gather_tp_param(p.grad, p, groups).double() - ref_params[name].grad.double()
        grads[name] = (diff.norm() / ref_params[name].grad.double().norm()).item()
    return {"init_mismatch": init_mismatch, "losses": losses, "grads": grads, "saved": saved}


def _tp_job(rank, world):
    reference = ParallelGroups.create(Layout())
    groups = {tp: ParallelGroups.create(Layout(tp=tp)) for tp in (1, 2)}
    return {name: _one_case(case, reference, groups[case.tp]) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return spawn(_tp_job, 2, timeout=150)


@pytest.mark.parametrize("name", list(CASES))
def test_weights_are_bitwise_slices_of_the_1_process_model(results, name):
    for rank in results:
        assert rank[name]["init_mismatch"] == []


@pytest.mark.parametrize("name", FP32_CASES)
def test_loss_and_every_gradient_match_the_1_process_model(results, name):
    for rank in results:
        ours, reference = rank[name]["losses"]
        assert ours == pytest.approx(reference, rel=1e-6)
        worst = max(rank[name]["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst


@pytest.mark.parametrize("name", list(CASES))
def test_activation_bytes_are_the_cost_models_exactly(results, name):
    saved = results[0][name]["saved"]
    assert saved["layer"] == [saved["predicted_layer"]] * TINY["layers"], saved
    assert saved["head"] == saved["predicted_head"]


def test_rotary_positions_rotate_each_pair_by_its_angle():
    positions, d = torch.tensor([0, 3]), 4
    cos, sin = rotary_tables(positions, d, 100.0)
    x = torch.tensor([1.0, 0.0, 0.0, 0.0]).expand(1, 1, 2, d)
    out = rotate(x, cos, sin)[0, 0]
    assert torch.equal(out[0], x[0, 0, 0])  # position 0 does not turn
    # pair 0 (dims 0 and 2) turns by 3 radians at position 3 (frequency 1)
    assert out[1].tolist() == pytest.approx([torch.cos(torch.tensor(3.0)).item(), 0.0,
                                             torch.sin(torch.tensor(3.0)).item(), 0.0])
