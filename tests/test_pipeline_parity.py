"""The pipeline runtime against the 1-process GPT: same seed, same batch, same loss and same
gradient for every parameter, for every schedule, pp in {2, 4}, and pp=2 x tp=2. And the
backward split (I then W) against the full backward (B), in one process.

One 4-process job runs every GPT case (pp=2 runs as two replicas of a 2-rank pipeline); each
rank also builds the 1-process reference in the same process. The tests below read its results.
"""

import functools
import tempfile
from unittest import mock
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from hybrid.planning.config import ModelConfig
from hybrid.groups import ParallelGroups
from hybrid.planning.layout import Layout
from hybrid.model import (
    GPT, allreduce_sequence_parallel_grads, build_blocks, gather_tp_param, lm_loss, num_blocks,
)
from hybrid.model.linear import linear
from hybrid.pipeline import backward
from hybrid.pipeline.backward import full_backward, input_backward
from hybrid.planning.schedules.partition import partition
from hybrid.planning.schedules.rank_check import rank_stages
from hybrid.pipeline.recorder import ActionRecorder, gather_events, write_timeline
from hybrid.pipeline.runtime import run_pipeline_step
from hybrid.planning.schedules import add_communication, build_schedule
from hybrid.testing import spawn

pytestmark = pytest.mark.timeout(240)

CFG = dict(layers=8, hidden=32, heads=4, vocab=120, vocab_pad_multiple=64, seq_len=16)
SEED, MICRO_BATCH, M, RTOL = 11, 1, 8, 1e-5

# name -> (pp, tp, schedule, vpp, sequence_parallel)
CASES = {
    f"pp{pp}-{name}": (pp, 1, name, 2 if name == "interleaved-1f1b" else 1, False)
    for pp in (2, 4) for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
}
CASES.update({
    f"pp2-tp2-{name}": (2, 2, name, 2 if name == "interleaved-1f1b" else 1, False)
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
})
CASES.update({"pp2-tp2-sp-1f1b": (2, 2, "1f1b", 1, True),
              "pp2-tp2-sp-zb-h1": (2, 2, "zb-h1", 1, True)})


def _batch():
    gen = torch.Generator().manual_seed(2024)
    shape = (M * MICRO_BATCH, CFG["seq_len"])
    return (torch.randint(0, CFG["vocab"], shape, generator=gen),
            torch.randint(0, CFG["vocab"], shape, generator=gen))


def _stage_chunks(cfg, groups, pp, vpp, sequence_parallel) -> dict[int, nn.Module]:
    stages = partition([1.0] * num_blocks(cfg), pp, vpp)
    return {s: nn.Sequential(*build_blocks(cfg, groups, seed=SEED, block_ids=list(stages[s]),
                                           sequence_parallel=sequence_parallel))
            for s in rank_stages(groups.pp_rank, pp, vpp)}


def _named_params(chunks):
    """Parameters under the reference GPT's names (``blocks.<block id>.<name>``)."""
    for chunk in chunks.values():
        for block in chunk:
            for name, param in block.named_parameters():
                yield f"blocks.{block.block_id}.{name}", param


def _run_case(case, groups, reference, tokens, labels, recorder=None) -> dict:
    pp, tp, schedule, vpp, sp = case
    cfg = ModelConfig(**CFG)
    chunks = _stage_chunks(cfg, groups, pp, vpp, sp)
    counts = {}  # the DP gradient sync counts these: one per parameter and micro-batch
    for _, param in _named_params(chunks):
        param.register_post_accumulate_grad_hook(
            lambda p: counts.update({p: counts.get(p, 0) + 1}))
    lists = add_communication(build_schedule(schedule, pp, M, vpp=vpp), pp, vpp)
    seq = CFG["seq_len"] // (tp if sp else 1)
    loss = run_pipeline_step(
        lists[groups.pp_rank], chunks,
        list(zip(tokens.split(MICRO_BATCH), labels.split(MICRO_BATCH))),
        groups=groups, pp=pp, vpp=vpp,
        loss_fn=functools.partial(lm_loss, groups=groups, vocab=CFG["vocab"]),
        act_shape=(seq, MICRO_BATCH, CFG["hidden"]), act_dtype=torch.float32, recorder=recorder)
    if sp:
        allreduce_sequence_parallel_grads(list(chunks.values()), groups.tensor)
    ref_params = dict(reference.named_parameters())
    bad, worst, names = [], 0.0, []
    for name, param in _named_params(chunks):
        names.append(name)
        grad = gather_tp_param(param.grad, param, groups)
        ref = ref_params[name].grad
        worst = max(worst, ((grad - ref).abs().max() / ref.abs().max()).item())
        if not torch.allclose(grad, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item()):
            bad.append(name)
    return {"loss": loss, "bad": bad, "worst": worst, "names": names,
            "accumulations": sorted(set(counts.values())),
            "pp_rank": groups.pp_rank, "tp_rank": groups.tp_rank}


def _all_cases(rank, world):
    reference_groups = ParallelGroups.create(Layout())
    tokens, labels = _batch()
    reference = GPT(ModelConfig(**CFG), reference_groups, seed=SEED)
    ref_loss = reference(tokens, labels)
    ref_loss.backward()
    layouts = {(pp, tp): ParallelGroups.create(Layout(pp=pp, tp=tp))
               for pp, tp, *_ in CASES.values()}
    results = {name: _run_case(case, layouts[case[:2]], reference, tokens, labels)
               for name, case in CASES.items()}
    results["reference"] = {"loss": ref_loss.item(),
                            "names": [n for n, _ in reference.named_parameters()]}
    results["timeline"] = _timeline(layouts[(4, 1)], reference, tokens, labels)
    return results


def _timeline(groups, reference, tokens, labels):
    """Record one interleaved step, gather it on the first stage's rank and draw it there."""
    recorder = ActionRecorder(groups.pp_rank)
    _run_case(CASES["pp4-interleaved-1f1b"], groups, reference, tokens, labels, recorder)
    events = gather_events(recorder.events, group=groups.pipeline, dst=groups.pipeline.ranks[0])
    if events is None:
        return None
    lists = add_communication(build_schedule("interleaved-1f1b", 4, M, vpp=2), 4, 2)
    with tempfile.TemporaryDirectory() as folder:
        report = write_timeline(events, lists, Path(folder) / "step", pp=4, m=M, vpp=2)
        report["png_bytes"] = Path(report["png"]).stat().st_size
    report["events"] = [(rank, str(action)) for rank, action, _, _ in events]
    return report


@pytest.fixture(scope="module")
def results():
    return spawn(_all_cases, 4, timeout=200)


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_every_gradient_match_the_one_process_model(results, name):
    pp, tp = CASES[name][:2]
    reference = results[0]["reference"]
    pipeline = [r[name] for r in results[:pp * tp]]  # the first replica
    losses = [r["loss"] for r in pipeline if r["pp_rank"] == pp - 1]
    assert len(losses) == tp and all(loss is not None for loss in losses)
    assert all(r["loss"] is None for r in pipeline if r["pp_rank"] != pp - 1)
    for loss in losses:
        assert loss == pytest.approx(reference["loss"], rel=RTOL)
    for r in pipeline:
        assert r["bad"] == [], f"{name}: gradients differ (worst max rel {r['worst']:.2e})"
        assert r["accumulations"] == [M]  # W, not I, accumulates; once per micro-batch
    covered = sorted(n for r in pipeline if r["tp_rank"] == 0 for n in r["names"])
    assert covered == sorted(reference["names"])  # every parameter on exactly one stage


def test_a_recorded_step_gathers_every_action_and_draws_its_timeline(results):
    report = results[0]["timeline"]
    lists = add_communication(build_schedule("interleaved-1f1b", 4, M, vpp=2), 4, 2)
    expected = sorted((rank, str(a)) for rank, actions in enumerate(lists) for a in actions)
    assert sorted(report["events"]) == expected  # every action of every rank, once
    assert 0 < report["measured"] < 1 and 0 < report["simulated"] < 1
    assert report["png_bytes"] > 10_000


def test_replicated_pipelines_agree(results):
    # With pp=2 on 4 processes, ranks 2-3 run a second, independent pipeline.
    for name in (n for n, case in CASES.items() if case[:2] == (2, 1)):
        assert results[1][name]["loss"] == results[3][name]["loss"]


# ----- the I/W split against the full backward, one process ---------------------------------
S, B, H = 4, 2, 8  # sequence, micro-batch, hidden


class BothGradsLinear(torch.autograd.Function):
    """Like megatron's linear: its backward makes the weight gradient whether asked or not."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class SplitProbe(nn.Module):
    """Built-in nodes (layer norm, F.linear), a custom Function, and a weight used twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.a = nn.LayerNorm(H), nn.Linear(H, H)
        self.custom = nn.Parameter(torch.randn(H, H) / 3)

    def forward(self, x):
        h = torch.tanh(self.a(self.norm(x)))
        h = BothGradsLinear.apply(h, self.custom) + x
        return self.a(h)  # self.a again: its gradient has two parts


def test_input_then_weight_backward_equals_the_full_backward_once_per_parameter():
    model, x, grad = SplitProbe(), torch.randn(S, B, H), torch.randn(S, B, H)
    inp = x.clone().requires_grad_()
    (expected_input,) = torch.autograd.grad(model(inp), inp, grad)
    full_backward(get_gradient_edge(model(x.clone().requires_grad_())), grad)
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    counts = {}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: counts.update({p: counts.get(p, 0) + 1}))

    inp = x.clone().requires_grad_()
    input_grad, weights = input_backward(get_gradient_edge(model(inp)), grad, inp)
    assert torch.equal(input_grad, expected_input)
    assert all(p.grad is None for p in model.parameters()) and not counts  # no dW in I
    # layer norm's cheap dW and the custom Function's dW came with I; F.linear runs again in W
    assert {bool(start.pinned) for start in weights.starts} == {True, False}
    weights.run()
    for p, want in zip(model.parameters(), expected):
        assert torch.allclose(p.grad, want, rtol=1e-6, atol=1e-7)
    assert sorted(counts.values()) == [1] * len(expected)  # the DP sync sees one per param
    assert not weights.starts  # W ran once and let the graph go


class SelfSplitProbe(nn.Module):
    """hybrid's own linear (which splits its backward itself), used twice, and a layer norm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(H)
        self.weight, self.bias = nn.Parameter(torch.randn(H, H) / 3), nn.Parameter(torch.randn(H))

    def forward(self, x):
        h = torch.tanh(linear(self.norm(x), self.weight, self.bias)) + x
        return linear(h, self.weight, self.bias)


def test_self_splitting_linears_defer_their_weight_gradient_and_free_the_graph_in_I():
    model, x, grad = SelfSplitProbe(), torch.randn(S, B, H), torch.randn(S, B, H)
    inp = x.clone().requires_grad_()
    out = model(inp)
    (expected_input,) = torch.autograd.grad(out, inp, grad, retain_graph=True)
    full_backward(get_gradient_edge(out), grad)
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    counts = {}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: counts.update({p: counts.get(p, 0) + 1}))

    inp = x.clone().requires_grad_()
    out = model(inp)
    input_grad, weights = input_backward(get_gradient_edge(out), grad, inp)
    assert torch.allclose(input_grad, expected_input, rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in model.parameters()) and not counts
    assert len(weights.self_split) == 2 and not any(s.pinned for s in weights.starts)
    with pytest.raises(RuntimeError, match="freed|second time"):
        out.grad_fn.saved_tensors  # nothing re-runs in W, so I let the graph go
    # every seed lands on a parameter's own accumulator: W runs those, not the engine; and the
    # seeds are values, with no graph recorded behind them
    accumulate = backward._accumulate
    seeds_need_grad = []
    with mock.patch.object(torch.autograd, "backward", side_effect=AssertionError("engine")), \
            mock.patch.object(backward, "_accumulate", side_effect=lambda start: (
                seeds_need_grad.extend(g.requires_grad for g in start.grads),
                accumulate(start))):
        weights.run()
    assert seeds_need_grad and not any(seeds_need_grad)
    for p, want in zip(model.parameters(), expected):
        assert torch.allclose(p.grad, want, rtol=1e-6, atol=1e-7)
    assert sorted(counts.values()) == [1] * len(expected)


def test_a_seed_unlike_its_parameter_goes_to_the_engine_which_checks_and_casts_it():
    param = nn.Parameter(torch.randn(3, 2))
    accumulator = get_gradient_edge(param).node
    for seed in (torch.ones(3, 2, dtype=torch.bfloat16), torch.ones(2)):
        start = backward._Start([get_gradient_edge(param)], [seed], {accumulator})
        assert backward._seeds_by_accumulator(start) is None
    start = backward._Start([get_gradient_edge(param)] * 2, [torch.ones(3, 2)] * 2, {accumulator})
    backward._accumulate(start)  # a parameter seeded twice accumulates their sum once
    assert torch.equal(param.grad, torch.full((3, 2), 2.0))


def test_weight_gradients_pass_through_a_parameters_tensor_hook():
    """A ``Tensor.register_hook`` hook on a parameter runs in the engine, not in its
    accumulator: W then goes through the engine, and the hook sees the summed gradient once."""
    model, x, grad = SelfSplitProbe(), torch.randn(S, B, H), torch.randn(S, B, H)
    seen = []
    model.weight.register_hook(lambda g: seen.append(g) or g * 2)
    full_backward(get_gradient_edge(model(x.clone().requires_grad_())), grad)
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    inp = x.clone().requires_grad_()
    _, weights = input_backward(get_gradient_edge(model(inp)), grad, inp)
    weights.run()
    for p, want in zip(model.parameters(), expected):
        assert torch.allclose(p.grad, want, rtol=1e-6, atol=1e-7)
    assert len(seen) == 2  # once in B, once in W: the weight's two uses summed each time
