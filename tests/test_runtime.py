"""The pipeline runtime's parts: per-rank list checks, message tags, the posting plan, and on 2
gloo processes (a small stand-in model): freed activations, the pp=1, compute-only and autocast
paths, and bad schedules or failed peers that end in a timeout, not a hang.
"""

import time
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybrid.groups import ParallelGroups
from hybrid.planning.layout import Layout
from hybrid.planning.schedules.actions import (
    V_SHAPE, Action, ScheduleError, from_text, rank_stages,
)
from hybrid.planning.schedules.dualpipev import dualpipev_steps
from hybrid.pipeline.p2p import fifo_mismatches, message_tag
from hybrid.planning.schedules.partition import partition
from hybrid.planning.schedules.rank_check import check_rank_actions, posting_plan
from hybrid.pipeline.runtime import prepare_rank, run_pipeline_step
from hybrid.planning.schedules import (
    schedule_names, add_communication, build_schedule, schedule_placement, schedule_spec,
)
from hybrid.testing import spawn

pytestmark = pytest.mark.timeout(120)

VOCAB, HIDDEN, SEQ, MB, M = 16, 8, 4, 2, 4
AUTOCAST_IN_BACKWARD = []


# ----- a stand-in model: embedding -> residual MLPs -> head, activations [s, b, h] -----------
class Embed(nn.Embedding):
    def forward(self, tokens):
        return super().forward(tokens.t())  # [b, s] -> [s, b, h]


class Residual(nn.Module):
    """Ends in a Linear, whose backward keeps its input, not its output."""

    def __init__(self):
        super().__init__()
        self.norm, self.up = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)
        self.outputs = []  # weak references to every output's memory, for the memory test

    def forward(self, x):
        out = self.down(F.gelu(self.up(self.norm(x)))) + x
        # The storage, not the tensor object: a sent activation lives on in its send buffer.
        self.outputs.append(weakref.ref(out.untyped_storage()))
        if torch.is_autocast_enabled("cpu"):  # is the backward of this output under autocast?
            out.register_hook(lambda _: AUTOCAST_IN_BACKWARD.append(
                torch.is_autocast_enabled("cpu")))
        return out


def _blocks(n_layers=4):
    """Embedding, ``n_layers`` residual blocks, head; each seeded by its position."""
    blocks = []
    for block_id in range(n_layers + 2):
        torch.manual_seed(block_id)
        blocks.append(Embed(VOCAB, HIDDEN) if block_id == 0 else nn.Linear(HIDDEN, VOCAB)
                      if block_id == n_layers + 1 else Residual())
        blocks[-1].block_id = block_id
    return blocks


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.t().reshape(-1))


def _data():
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (M * MB, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (M * MB, SEQ), generator=gen)
    return tokens, labels, list(zip(tokens.split(MB), labels.split(MB)))


def _reference():
    """Loss and per-block gradients of the stand-in model on the whole batch, one process."""
    tokens, labels, _ = _data()
    blocks = _blocks()
    loss = _loss(nn.Sequential(*blocks)(tokens), labels)
    loss.backward()
    return loss.item(), [[p.grad for p in block.parameters()] for block in blocks]


# ----- pure checks ---------------------------------------------------------------------------
def _rank_list(name, pp, m, rank, vpp=1):
    return add_communication(build_schedule(name, pp, m, vpp), pp, vpp)[rank]


@pytest.mark.parametrize("mutate, message", [
    (lambda a: [x for x in a if str(x) != "0B2"], "lacks 0B2"),
    (lambda a: a + [Action(0, "SEND_B", 0)], "which no stage needs"),
    (lambda a: a + [Action(1, "F", 0)], "which rank 0 does not hold"),
    (lambda a: a + a[:1], "more than once"),
    (lambda a: [Action(0, "B", 0)] + [x for x in a if str(x) != "0B0"], "runs before 0F0"),
    (lambda a: [Action(0, "F", 9)] + a, "micro-batch 9"),
])
def test_a_bad_rank_list_is_refused_before_any_message(mutate, message):
    actions = mutate(_rank_list("1f1b", 2, 4, 0))
    with pytest.raises(ScheduleError, match=message):
        check_rank_actions(actions, [0], rank=0, pp=2, vpp=1, m=4)


def test_stage_modules_must_match_the_rank():
    with pytest.raises(ScheduleError, match="holds stages \\[1, 3\\]"):
        check_rank_actions(_rank_list("interleaved-1f1b", 2, 4, 1, vpp=2), [1], rank=1, pp=2,
                           vpp=2, m=4)


@pytest.mark.parametrize("name", schedule_names())
@pytest.mark.parametrize("pp", [2, 4])
def test_every_message_of_a_step_has_its_own_tag_and_fifo_order(name, pp):
    vpp, m = (2, 2 * pp) if schedule_spec(name).chunks != "one" else (1, 2 * pp)
    placement = schedule_placement(name)
    lists = add_communication(build_schedule(name, pp, m, vpp), pp, vpp, placement)
    sends = [a for actions in lists for a in actions if a.kind.startswith("SEND")]
    recvs = [a for actions in lists for a in actions if a.kind.startswith("RECV")]
    assert len({message_tag(a, m) for a in sends}) == len(sends)
    assert {message_tag(a, m) for a in sends} == {message_tag(a, m) for a in recvs}
    # so NCCL, ignoring tags, matches them too; zb-v and dualpipev are not FIFO yet (their
    # specs say tag_matched: validate keeps them on gloo, which matches by tag)
    mismatches = fifo_mismatches(lists, pp, placement)
    if not schedule_spec(name).tag_matched:
        assert mismatches == []
    elif pp == 4:
        assert mismatches  # the flag is needed (dualpipev happens to be FIFO at pp=2)


@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_posting_plan_posts_each_message_once_and_every_recv_before_its_consumer(lookahead):
    actions = _rank_list("zb-h1", 4, 8, 1)  # a middle stage: every F and I consumes a RECV
    plan, posted = posting_plan(actions, lookahead), []
    assert [a for _, a in plan if a is not None] == [a for a in actions if a.is_compute]
    for posts, action in plan:
        posted += posts
        if action is not None and action.kind != "W":
            assert Action(1, "RECV_" + ("F" if action.kind == "F" else "B"), action.mb) in posted
    assert sorted(posted) == sorted(a for a in actions if a.is_comm)


def test_fifo_mismatches_names_a_pair_received_out_of_order():
    lists = from_text("rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0B1 0RECV_B0 0B0\n"
                      "rank 1: 1RECV_F1 1RECV_F0 1F0 1F1 1B1 1SEND_B1 1B0 1SEND_B0\n")
    assert fifo_mismatches(lists, 2) == [(0, 1)]


# ----- on 2 gloo processes ------------------------------------------------------------------
def _stage_chunks(groups, pp, vpp, placement="loop"):
    blocks = _blocks()
    stages = partition([1.0] * len(blocks), pp, vpp)
    return {s: nn.Sequential(*[blocks[b] for b in stages[s]])
            for s in rank_stages(groups.pp_rank, pp, vpp, placement)}


def _run(groups, name, pp, vpp, *, lists=None, chunks=None, m=M, bf16=False, **options):
    """One step of the stand-in model; returns (loss, worst relative gradient error)."""
    chunks = chunks or _stage_chunks(groups, pp, vpp)
    if lists is None:
        lists = add_communication(build_schedule(name, pp, m, vpp), pp, vpp)
    options = {"act_shape": (SEQ, MB, HIDDEN), "loss_fn": _loss, **options}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = run_pipeline_step(lists[groups.pp_rank], chunks, _data()[2][:m], groups=groups,
                                 pp=pp, vpp=vpp, act_dtype=torch.float32, **options)
    if m != M:
        return loss, None
    expected = _reference()[1]
    return loss, max(((p.grad - ref).abs().max() / ref.abs().max()).item()
                     for chunk in chunks.values() for block in chunk
                     for p, ref in zip(block.parameters(), expected[block.block_id]))


class LiveOutputs:
    """A recorder that counts, after each backward, the sent activations still alive."""

    def __init__(self, block):
        self.block, self.after_backward = block, []

    def record(self, action, start_s, end_s):
        if action.kind == "B":
            self.after_backward.append(sum(ref() is not None for ref in self.block.outputs))


def _failure(run):
    start = time.monotonic()
    try:
        run()
    except Exception as error:  # noqa: BLE001 - the test reads which error it was
        return type(error).__name__, str(error), time.monotonic() - start
    return None, "", time.monotonic() - start


def _raise_on_loss(logits, labels):
    raise RuntimeError("this stage failed")


def _runtime_cases(rank, world):
    out = {"reference_loss": _reference()[0]}
    solo = ParallelGroups.create(Layout())  # pp=1 on each process: chunks hand over locally
    out["pp1"] = _run(solo, "interleaved-1f1b", 1, 2)
    out["bf16"] = _run(solo, "interleaved-1f1b", 1, 2, bf16=True)
    out["autocast-in-backward"] = list(AUTOCAST_IN_BACKWARD)
    out["bad-shape"] = _failure(lambda: _run(solo, "interleaved-1f1b", 1, 2,
                                             act_shape=(SEQ, MB, HIDDEN + 1)))
    pipe = ParallelGroups.create(Layout(pp=2))
    chunks = _stage_chunks(pipe, 2, 1)
    counts = {}
    for p in (p for c in chunks.values() for p in c.parameters()):
        p.register_post_accumulate_grad_hook(lambda p: counts.update({p: counts.get(p, 0) + 1}))
    out["zb-h1"] = _run(pipe, "zb-h1", 2, 1, chunks=chunks)
    out["accumulations"] = sorted(set(counts.values()))
    out["interleaved-1f1b"] = _run(pipe, "interleaved-1f1b", 2, 2)
    # DualPipeV's lists with each overlapped pair one composite action: on CPU its parts run
    # in order; the V puts the last stage (and so the loss) on rank 0
    v_chunks = _stage_chunks(pipe, 2, 2, placement=V_SHAPE)
    out["dualpipev-composite"] = _run(pipe, "dualpipev", 2, 2, lists=dualpipev_steps(2, M),
                                      chunks=v_chunks, placement=V_SHAPE)
    compute_only = build_schedule("1f1b", 2, M)
    out["compute-only"] = _run(pipe, "1f1b", 2, 1, lists=compute_only)
    chunks = _stage_chunks(pipe, 2, 1)
    plan = prepare_rank(compute_only[pipe.pp_rank], chunks, groups=pipe, pp=2, vpp=1, m=M)
    out["planned"] = _run(pipe, "1f1b", 2, 1, chunks=chunks, lists=[plan, plan])
    out["plan-for-other-m"] = _failure(lambda: _run(pipe, "1f1b", 2, 1, chunks=chunks,
                                                    lists=[plan, plan], m=M - 2))

    chunks = _stage_chunks(pipe, 2, 1)
    probe = LiveOutputs(chunks[0][-1]) if 0 in chunks else None
    _run(pipe, "gpipe", 2, 1, chunks=chunks, recorder=probe)
    if probe is not None:
        out["live-after-backward"] = probe.after_backward
        out["live-after-step"] = sum(ref() is not None for ref in probe.block.outputs)
        out["outputs-made"] = len(probe.block.outputs)

    # Last: after a timeout the pair's gloo state is not reused.
    deadlock = from_text("rank 0: 0F0 0RECV_B0 0B0 0SEND_F0\n"
                         "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0\n")
    out["deadlock"] = _failure(lambda: _run(pipe, "1f1b", 2, 1, lists=deadlock, m=1,
                                            recv_timeout_s=1.0))
    failing = ParallelGroups.create(Layout(pp=2))
    out["peer-failed"] = _failure(lambda: _run(failing, "1f1b", 2, 1, m=1, recv_timeout_s=1.0,
                                               loss_fn=_raise_on_loss))
    return out


def test_dualpipev_composite_actions_run_their_parts_in_order_and_match_the_reference(cases):
    for rank, result in enumerate(cases):
        loss, worst = result["dualpipev-composite"]
        assert worst < 1e-5
        if rank == 0:  # V: rank 0 holds the last stage
            assert loss == pytest.approx(result["reference_loss"], rel=1e-6)
        else:
            assert loss is None


@pytest.fixture(scope="module")
def cases():
    return spawn(_runtime_cases, 2, timeout=90)


@pytest.mark.parametrize("name", ["pp1", "zb-h1", "interleaved-1f1b", "compute-only",
                                  "planned"])
def test_stand_in_model_matches_its_reference(cases, name):
    for rank, result in enumerate(cases):
        loss, worst = result[name]
        assert worst < 1e-5
        if rank == 1 or name == "pp1":  # the rank holding the last stage reports the loss
            assert loss == pytest.approx(result["reference_loss"], rel=1e-6)
        else:
            assert loss is None


def test_a_rank_plan_is_refused_for_another_batch_before_any_message(cases):
    for result in cases:
        kind, message, _ = result["plan-for-other-m"]
        assert kind == "ScheduleError" and "\n" not in message
        assert "made for (rank, pp, vpp, m, placement, stages, lookahead, forward only)=(" in message
        assert f", 2, 1, {M}, 'loop'," in message and f", 2, 1, {M - 2}, 'loop'," in message


def test_a_trainer_plans_its_list_once_and_again_only_when_the_list_changes(monkeypatch):
    from hybrid import train

    made = []
    monkeypatch.setattr(train, "prepare_rank", lambda actions, chunks, **kw: made.append(
        (actions, kw)) or object())
    trainer = SimpleNamespace(actions=_rank_list("1f1b", 2, 4, 0), chunks={}, _schedule_m=4,
                              groups=SimpleNamespace(layout=Layout(pp=2)), _planned=None)
    first = [train.Trainer._rank_plan(trainer) for _ in range(3)]
    assert first[0] is first[1] is first[2] and len(made) == 1
    assert made[0][1] == {"groups": trainer.groups, "pp": 2, "vpp": 1, "m": 4,
                          "placement": "loop"}
    trainer.actions = _rank_list("zb-h1", 2, 4, 0)  # a bench swapping the schedule
    assert train.Trainer._rank_plan(trainer) is not first[0] and len(made) == 2


def test_under_autocast_forwards_run_in_bf16_and_backwards_outside_autocast(cases):
    loss, worst = cases[0]["bf16"]
    assert loss == pytest.approx(cases[0]["reference_loss"], rel=2e-2) and worst < 0.1
    assert cases[0]["autocast-in-backward"] and not any(cases[0]["autocast-in-backward"])


def test_weight_gradients_accumulate_once_per_micro_batch(cases):
    assert all(result["accumulations"] == [M] for result in cases)


def test_sent_activations_are_freed_once_received(cases):
    sender = cases[0]
    assert sender["outputs-made"] == M
    # GPipe runs all M forwards before the first backward; holding sent activations until
    # the end of the step would read [4, 4, 4, 4] here (the runtime keeps autograd edges only)
    assert sender["live-after-backward"][-1] == 0
    assert sender["live-after-step"] == 0


def test_wrong_activation_shape_is_a_one_line_value_error(cases):
    kind, message, _ = cases[0]["bad-shape"]
    assert kind == "ValueError" and "act_shape=[4, 2, 9]" in message and "\n" not in message


def test_a_deadlocking_list_or_a_failed_peer_ends_in_a_timeout_not_a_hang(cases):
    for rank, result in enumerate(cases):
        kind, message, seconds = result["deadlock"]
        assert kind == "PipelineTimeout" and seconds < 20
        assert f"{rank}RECV_{'B' if rank == 0 else 'F'}0" in message
    assert cases[1]["peer-failed"][:2] == ("RuntimeError", "this stage failed")
    kind, message, seconds = cases[0]["peer-failed"]
    assert kind == "PipelineTimeout" and "0RECV_B0" in message and seconds < 20
