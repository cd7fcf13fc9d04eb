"""Evaluation's pieces: forward-only schedules proved for every registered schedule, the
held-out synthetic data, and the eval settings' rules."""

import numpy as np
import pytest

from hybrid.data import MarkovDataset
from hybrid.data.synthetic import HeldOutMarkov
from hybrid.planning.config import DataConfig, EvalConfig
from hybrid.planning.data_sources import eval_problem
from hybrid.planning.schedules import (SCHEDULES, add_communication, build_schedule,
                                       forward_only, schedule_placement)
from hybrid.planning.schedules.actions import ScheduleError
from hybrid.planning.schedules.check import check_schedule
from hybrid.planning.schedules.rank_check import plan_rank

def _runs(name, pp, vpp, m) -> bool:
    try:
        build_schedule(name, pp, m, vpp=vpp)
    except ScheduleError:
        return False  # e.g. zb-h1 has no vpp=2, zb-v needs vpp=2
    return True


CASES = [(name, pp, vpp, m) for name in SCHEDULES
         for pp, vpp, m in [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)] if _runs(name, pp, vpp, m)]


@pytest.mark.parametrize("name, pp, vpp, m", CASES)
def test_every_schedules_forwards_alone_are_complete_and_deadlock_free(name, pp, vpp, m):
    compute = build_schedule(name, pp, m, vpp=vpp)
    placement = schedule_placement(name)
    lists = forward_only(add_communication(compute, pp, vpp, placement))
    check_schedule(lists, pp, m, vpp, placement, forward_only=True)
    for rank, actions in enumerate(lists):
        plan = plan_rank(actions, sorted({a.stage for a in actions}), rank=rank, pp=pp,
                         vpp=vpp, m=m, placement=placement, forward_only=True)
        assert plan.forward_only and all(a.kind == "F" for _, a in plan.posting if a)
    with pytest.raises(ScheduleError, match="is missing"):  # a training step needs backwards
        check_schedule(lists, pp, m, vpp, placement)


def test_held_out_walks_are_the_same_chain_but_never_a_training_sample():
    train = MarkovDataset(vocab=64, seq_len=16, samples=32, seed=9)
    held = HeldOutMarkov(train, 8)
    assert held.ordered and len(held) == 8
    trained = {tuple(train[i]) for i in range(len(train))}
    assert not trained & {tuple(held[i]) for i in range(len(held))}
    successors = {(a, b) for a, row in enumerate(train.successors) for b in row}
    walk = held[3]
    assert all((int(a), int(b)) in successors for a, b in zip(walk[:-1], walk[1:]))
    with pytest.raises(IndexError):
        held[8]
    np.testing.assert_array_equal(held[0], train.walk(32))


@pytest.mark.parametrize("eval_cfg, data, needle", [
    (EvalConfig(every=-1), DataConfig(), "eval.every=-1 must be an integer >= 0"),
    (EvalConfig(batches=0), DataConfig(), "eval.batches=0 must be an integer >= 1"),
    (EvalConfig(every=5), DataConfig(source="tokens", path="t.bin"),
     "eval.every=5 needs validation data, and data=tokens has none"),
    (EvalConfig(at_end=True), DataConfig(source="indexed", path="p", split=[1, 0, 0]),
     "eval.at_end=true needs validation data, and data.split=[1,0,0] has no validation part"),
])
def test_eval_settings_are_checked_with_the_data(eval_cfg, data, needle):
    assert needle in eval_problem(eval_cfg, data)


def test_eval_off_or_with_validation_data_is_fine():
    assert eval_problem(EvalConfig(), DataConfig(source="tokens", path="t.bin")) is None
    assert eval_problem(EvalConfig(every=3), DataConfig()) is None
    assert eval_problem(EvalConfig(every=3), DataConfig(source="indexed", path="p")) is None
