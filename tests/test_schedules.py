"""Pipeline schedules as data: actions, builders, lowering, the checker and text/CSV forms."""


import pytest

from hybrid.planning.schedules.actions import (
    ALL_KINDS, Action, ScheduleError, dump_csv, from_text, load_csv, to_text,
)
from hybrid.planning.schedules.check import MARK, check_schedule, format_table
from hybrid.planning.schedules import add_communication, build_schedule

A = Action.parse


def _combos():
    """(name, pp, m, vpp) for every schedule over a spread of sizes, uneven m included."""
    for pp in (1, 2, 3, 4, 8):
        for m in sorted({1, 3, 5, pp, 2 * pp, 4 * pp, 8}):
            yield "gpipe", pp, m, 1
            yield "1f1b", pp, m, 1
            yield "zb-h1", pp, m, 1
            if m % pp == 0:
                for vpp in (2, 3, 4):
                    yield "interleaved-1f1b", pp, m, vpp


COMBOS = list(_combos())


# ----- actions and their text forms ----------------------------------------------------------
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_action_text_round_trips_for_every_kind(kind):
    for stage, mb in ((0, 0), (2, 13), (31, 7)):
        action = Action(stage, kind, mb)
        assert Action.parse(str(action)) == action
    assert str(Action(2, "F", 0)) == "2F0"
    assert A("3RECV_B1") == Action(3, "RECV_B", 1)
    assert A("12SEND_F30") == Action(12, "SEND_F", 30)


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "2 F 0", "-1F0", "2SEND0", "2F0x"])
def test_action_parse_rejects_malformed_text(text):
    with pytest.raises(ScheduleError, match="cannot read action"):
        Action.parse(text)


def test_action_rejects_unknown_kind():
    with pytest.raises(ScheduleError, match="unknown action kind"):
        Action(0, "X", 0)


@pytest.mark.parametrize("lowered", [False, True])
def test_text_and_csv_round_trip(tmp_path, lowered):
    lists = build_schedule("interleaved-1f1b", 4, 8, 2)
    if lowered:
        lists = add_communication(lists, 4, 2)
    assert from_text(to_text(lists)) == lists
    dump_csv(lists, tmp_path / "schedule.csv")
    assert load_csv(tmp_path / "schedule.csv") == lists


def test_text_and_csv_keep_an_empty_rank(tmp_path):
    lists = [[A("0F0"), A("0B0")], []]
    assert from_text(to_text(lists)) == lists
    dump_csv(lists, tmp_path / "s.csv")
    assert load_csv(tmp_path / "s.csv") == lists


def test_from_text_names_the_bad_line():
    with pytest.raises(ScheduleError, match="should start with 'rank 1:'"):
        from_text("rank 0: 0F0 0B0\nrank 2: 1F0\n")


# ----- builders ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,pp,m,vpp", COMBOS)
def test_every_schedule_passes_the_checker_compute_only_and_lowered(name, pp, m, vpp):
    lists = build_schedule(name, pp, m, vpp)
    assert len(lists) == pp
    assert all(action.is_compute for actions in lists for action in actions)
    check_schedule(lists, pp, m, vpp)
    check_schedule(add_communication(lists, pp, vpp), pp, m, vpp)


def test_backward_kinds_per_schedule():
    kinds = {name: {a.kind for actions in build_schedule(name, 4, 8, vpp) for a in actions}
             for name, vpp in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                               ("zb-h1", 1))}
    assert kinds == {"gpipe": {"F", "B"}, "1f1b": {"F", "B"},
                     "interleaved-1f1b": {"F", "B"}, "zb-h1": {"F", "I", "W"}}


def test_1f1b_and_zb_h1_orders_on_a_small_pipeline():
    assert to_text(build_schedule("1f1b", 2, 3)) == (
        "rank 0: 0F0 0F1 0B0 0F2 0B1 0B2\n"
        "rank 1: 1F0 1B0 1F1 1B1 1F2 1B2\n")
    # the last rank delays each W by one micro-batch, the first rank does not delay W
    assert to_text(build_schedule("zb-h1", 2, 3)) == (
        "rank 0: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2\n"
        "rank 1: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2\n")


def test_interleaved_places_stage_s_on_rank_s_mod_pp_and_follows_megatron_order():
    lists = build_schedule("interleaved-1f1b", 2, 4, 2)
    for rank, actions in enumerate(lists):
        assert {a.stage % 2 for a in actions} == {rank}
    # rank 1: warm-up of (vpp-1)*pp = 2 forwards of chunk 0, then 1F1B; chunk 1 is stage 3
    assert to_text([lists[1]]).split(": ")[1].split()[:6] == [
        "1F0", "1F1", "3F0", "3B0", "3F1", "3B1"]


@pytest.mark.parametrize("args,match", [
    (("pipedream", 4, 8, 1), "unknown schedule 'pipedream'; use one of"),
    (("interleaved-1f1b", 4, 6, 2), r"micro-batches \(6\) to be a multiple of pp \(4\); "
                                    r"use 8 micro-batches"),
    (("interleaved-1f1b", 4, 8, 1), "needs vpp >= 2"),
    (("1f1b", 4, 8, 2), "set vpp=1 or use interleaved-1f1b"),
    (("zb-h1", 4, 8, 2), "set vpp=1 or use interleaved-1f1b"),
    (("gpipe", 0, 8, 1), "pp to be an integer >= 1"),
    (("gpipe", 2, 0, 1), "micro-batches to be an integer >= 1"),
])
def test_build_schedule_errors_are_one_actionable_line(args, match):
    with pytest.raises(ScheduleError, match=match) as caught:
        build_schedule(*args)
    assert "\n" not in str(caught.value)


# ----- lowering ------------------------------------------------------------------------------
def test_add_communication_puts_recv_right_before_and_send_right_after():
    lowered = add_communication(build_schedule("1f1b", 2, 2), 2, 1)
    assert to_text(lowered) == (
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1\n")


def test_add_communication_for_zb_h1_moves_input_grads_only():
    lowered = add_communication(build_schedule("zb-h1", 3, 3), 3, 1)
    for actions in lowered:
        for step, action in enumerate(actions):
            if action.kind == "RECV_B":
                assert actions[step + 1] == Action(action.stage, "I", action.mb)
            if action.kind == "SEND_B":
                assert actions[step - 1] == Action(action.stage, "I", action.mb)
    assert sum(a.kind == "SEND_B" for a in lowered[1]) == 3


def test_add_communication_with_one_rank_adds_nothing():
    lists = build_schedule("interleaved-1f1b", 1, 3, 3)
    assert add_communication(lists, 1, 3) == lists


def test_add_communication_rejects_lowered_input_and_wrong_rank_count():
    lowered = add_communication(build_schedule("1f1b", 2, 2), 2, 1)
    with pytest.raises(ScheduleError, match="call add_communication on compute-only lists"):
        add_communication(lowered, 2, 1)
    with pytest.raises(ScheduleError, match="got 2 rank lists for pp=3"):
        add_communication(build_schedule("1f1b", 2, 2), 3, 1)


# ----- the checker ---------------------------------------------------------------------------
def _check_fails(lists, pp, m, vpp=1):
    with pytest.raises(ScheduleError) as caught:
        check_schedule(lists, pp, m, vpp)
    first, _, table = str(caught.value).partition("\n")
    assert table.startswith("step | rank 0"), "the table follows the one-line reason"
    return first, table


def test_checker_finds_a_missing_backward():
    lists = build_schedule("1f1b", 2, 2)
    first, _ = _check_fails([lists[0][:-1], lists[1]], 2, 2)
    assert first == "0B1 is missing; add it to rank 0"


def test_checker_finds_a_duplicate_and_marks_both_copies():
    lists = build_schedule("gpipe", 2, 2)
    first, table = _check_fails([lists[0] + [A("0F1")], lists[1]], 2, 2)
    assert first == "0F1 appears 2 times; keep exactly one"
    assert table.count(MARK + "0F1") == 2


def test_checker_finds_an_action_on_the_wrong_rank_or_out_of_range():
    lists = build_schedule("1f1b", 2, 2)
    first, table = _check_fails([lists[0] + [A("1F0")], lists[1]], 2, 2)
    assert first == "1F0 is on rank 0 but stage 1 lives on rank 1"
    assert MARK + "1F0" in table
    first, _ = _check_fails([lists[0] + [A("0F5")], lists[1]], 2, 2)
    assert "out of range" in first


def test_checker_finds_b_mixed_with_i_and_w():
    lists = build_schedule("zb-h1", 2, 2)
    first, _ = _check_fails([lists[0] + [A("0B1")], lists[1]], 2, 2)
    assert first.startswith("0B1 is not needed: this (stage, micro-batch) already splits")


def test_checker_finds_a_backward_before_its_forward_on_the_same_rank():
    lists = [[A("0F0"), A("0F1"), A("0B0"), A("0B1")],
             [A("1B0"), A("1F0"), A("1F1"), A("1B1")]]
    first, table = _check_fails(lists, 2, 2)
    assert first.startswith("rank 1 step 0: 1B0 runs before 1F0")
    assert MARK + "1B0" in table


def test_checker_finds_a_deadlock_in_compute_only_lists():
    # rank 1 wants micro-batch 1 first, but rank 0 only sends it after waiting on rank 1
    lists = [[A("0F0"), A("0B0"), A("0F1"), A("0B1")],
             [A("1F1"), A("1F0"), A("1B0"), A("1B1")]]
    first, table = _check_fails(lists, 2, 2)
    assert first == "deadlock: rank 0 at 0B0 waits for 1B0/1I0; rank 1 at 1F1 waits for 0F1"
    assert MARK + "0B0" in table and MARK + "1F1" in table


def test_checker_finds_a_deadlock_from_a_receive_posted_too_early():
    lists = [[A("0F0"), A("0RECV_B0"), A("0SEND_F0"), A("0B0")],
             [A("1RECV_F0"), A("1F0"), A("1B0"), A("1SEND_B0")]]
    first, _ = _check_fails(lists, 2, 1)
    assert first == ("deadlock: rank 0 at 0RECV_B0 waits for 1SEND_B0; "
                     "rank 1 at 1RECV_F0 waits for 0SEND_F0")


def test_checker_requires_every_message_once_lowered():
    lowered = add_communication(build_schedule("1f1b", 2, 2), 2, 1)
    without_send = [[a for a in lowered[0] if str(a) != "0SEND_F1"], lowered[1]]
    first, _ = _check_fails(without_send, 2, 2)
    assert first == "0SEND_F1 is missing; add it to rank 0"
    first, _ = _check_fails([lowered[0] + [A("0SEND_B0")], lowered[1]], 2, 2)
    assert first.startswith("0SEND_B0 is not needed")


def test_checker_rejects_wrong_rank_count():
    with pytest.raises(ScheduleError, match="has 1 rank lists but pp=2"):
        check_schedule([[]], 2, 1)


def test_format_table_is_step_by_rank_with_marks():
    table = format_table([[A("0F0"), A("0B0")], [A("1F0")]], marks={(1, 0)})
    assert table.splitlines() == [
        "step | rank 0 | rank 1",
        "----------------------",
        "   0 | 0F0    | >>1F0",
        "   1 | 0B0    |",
    ]



def test_every_registered_schedule_is_documented_where_people_choose_one():
    from pathlib import Path

    from hybrid.planning.schedules import SCHEDULES

    root = Path(__file__).resolve().parent.parent
    reference = (root / "docs" / "config.md").read_text()
    choices = next(line for line in reference.splitlines() if "`parallel.schedule`" in line)
    pipeline_doc = (root / "docs" / "pipeline.md").read_text()
    for name, spec in SCHEDULES.items():
        assert name in choices and f"`{name}`" in pipeline_doc, name
        assert spec.doc, name
