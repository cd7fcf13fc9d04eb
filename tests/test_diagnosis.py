"""Pure parts of hang and straggler diagnosis: who never arrived, the line, failure.json, and
the straggler watch (no processes; the end-to-end stalls are in test_stall.py)."""

import json

import pytest

from hybrid.planning.layout import Layout
from hybrid.diagnosis.stall import describe_wait, failure_document, never_arrived, stall_line
from hybrid.diagnosis.stragglers import RankTimesLog, StragglerWatch, peer_sets, ratios, step_summary

LAYOUT = Layout(dp=2, tp=2, pp=2)


def coords_of(rank):  # as the trainer's: no cp coordinate at cp=1
    return {axis: i for axis, i in LAYOUT.coords(rank).items() if axis != "cp"}


def node_of(rank):
    return rank // 4


def tp_wait(ranks, seq, waited=20.0):
    return {"axis": "tp", "op": "all_reduce", "ranks": ranks, "seq": seq, "peer": None,
            "action": None, "waited_s": waited}


def report(rank, step, waiting):
    return {"rank": rank, "step": step, "waiting": waiting, "error": "Timed out"}


def test_a_collective_names_the_members_that_are_not_in_it():
    reports = {2: report(2, 4, tp_wait([2, 3], 7))}
    assert never_arrived(reports[2], reports) == [3]
    reports[3] = report(3, 4, tp_wait([2, 3], 7))  # in the same collective: arrived
    assert never_arrived(reports[2], reports) == []
    reports[3] = report(3, 4, tp_wait([2, 3], 8))  # one collective further: not this one
    assert never_arrived(reports[2], reports) == [3]
    reports[3] = report(3, 5, tp_wait([2, 3], 7))  # another step
    assert never_arrived(reports[2], reports) == [3]


def test_a_pipeline_receive_names_its_peer_and_what_the_peer_waits_on():
    recv = {"axis": "pp", "op": "recv", "ranks": [1, 5], "seq": None, "peer": 1,
            "action": "1RECV_F3", "action_stage": 1, "action_mb": 3, "waited_s": 20.04}
    reports = {5: report(5, 2, recv), 1: report(1, 2, tp_wait([0, 1], 3))}
    assert never_arrived(reports[5], reports) == [1]
    line = stall_line(reports[5], reports, coords_of, node_of)
    assert line.startswith("rank 5 (dp 0, tp 1, pp 1, node 1) waited 20.0s at step 2 in "
                           "pipeline 1RECV_F3 (micro-batch 3 of stage 1) from rank 1; ")
    assert line.endswith("never arrived: rank 1 (dp 0, tp 1, pp 0, node 0), itself waiting at "
                         "step 2 in TP all_reduce #3 over ranks [0, 1], where rank 0 (dp 0, "
                         "tp 0, pp 0, node 0) never arrived, no report: stopped, dead, or busy "
                         "outside any collective")


def test_a_chain_of_waits_is_followed_to_the_silent_rank_and_cycles_end():
    reports = {0: report(0, 2, {"axis": "pp", "op": "recv", "ranks": [4], "seq": None,
                                "peer": 4, "action": "0RECV_B2", "action_stage": 0,
                                "action_mb": 2, "waited_s": 20.0}),
               4: report(4, 2, tp_wait([4, 5], 32))}
    line = stall_line(reports[0], reports, coords_of, node_of)
    assert line.endswith("never arrived: rank 4 (dp 0, tp 0, pp 1, node 1), itself waiting at "
                         "step 2 in TP all_reduce #32 over ranks [4, 5], where rank 5 (dp 0, "
                         "tp 1, pp 1, node 1) never arrived, no report: stopped, dead, or busy "
                         "outside any collective")
    cycle = {0: report(0, 2, {**reports[0]["waiting"]}),
             4: report(4, 2, {**reports[0]["waiting"], "peer": 0, "ranks": [0]})}
    assert stall_line(cycle[0], cycle, coords_of, node_of).count("itself waiting") == 1


def test_the_line_says_when_a_rank_never_reported():
    reports = {0: report(0, 9, {**tp_wait([0, 2], 1), "axis": "dp"})}
    line = stall_line(reports[0], reports, coords_of, node_of)
    assert "in DP all_reduce #1 over ranks [0, 2]" in line
    assert line.endswith("never arrived: rank 2 (dp 1, tp 0, pp 0, node 0), no report: stopped, "
                         "dead, or busy outside any collective")


def test_failure_json_holds_every_rank_reported_or_silent():
    waiting = tp_wait([2, 3], 1)
    reports = {2: {**report(2, 4, waiting), "host": "n1", "last_started": "0F1",
                   "last_finished": "0F0"}}
    doc = failure_document("the line", reports, 4, coords_of, node_of)
    json.dumps(doc)  # JSON-able as it is
    assert doc["diagnosis"] == "the line" and doc["silent_ranks"] == [0, 1, 3]
    assert doc["ranks"]["2"]["waiting"] == waiting and doc["ranks"]["2"]["reported"]
    assert doc["ranks"]["2"]["last_started"] == "0F1"
    assert doc["ranks"]["3"] == {"coords": {"dp": 1, "tp": 1, "pp": 0}, "node": 0,
                                 "reported": False}


def test_describe_wait_reads_like_the_schedule():
    assert describe_wait(tp_wait([0, 1], 12)) == "TP all_reduce #12 over ranks [0, 1]"
    send = {"axis": "pp", "op": "send", "ranks": [6], "seq": None, "peer": 6,
            "action": "0SEND_F3", "action_stage": 0, "action_mb": 3}
    assert describe_wait(send) == "pipeline 0SEND_F3 (micro-batch 3 of stage 0) to rank 6"


def test_peers_are_the_ranks_of_the_same_stage():
    assert peer_sets([0, 0, 1, 1]) == [[1], [0], [3], [2]]
    assert peer_sets([0, 1]) == [[], []]  # pipeline only: nobody does the same work
    assert ratios([1.0, 2.0], [[], []]) == [1.0, 1.0]


def test_a_straggler_is_named_once_it_was_slow_in_9_of_12_steps_and_once_only():
    watch = StragglerWatch(pp_of_rank=[0, 0, 0, 0], threshold=1.2)
    slow, normal = [1.0, 1.0, 1.5, 1.0], [1.0] * 4
    assert [watch.update(slow, 2.0) for _ in range(8)] == [[]] * 8
    (found,) = watch.update(slow, 2.0)
    assert found.rank == 2 and found.ratio == pytest.approx(1.5) and found.steps == 9
    assert watch.update(slow, 2.0) == []  # named once
    for _ in range(5):  # slow in 5 of 12: not recovered, not named again
        assert watch.update(normal, 2.0) == []
    assert watch.update(slow, 2.0) == [] and watch.update(slow, 2.0) == []
    for _ in range(8):  # recovers once at most 4 of its last 12 steps are slow ...
        assert watch.update(normal, 2.0) == []
    again = [watch.update(slow, 2.0) for _ in range(9)]  # ... named again after 9 more
    assert [[s.rank for s in found] for found in again] == [[]] * 8 + [[2]]


def test_a_straggler_of_a_tiny_step_is_named():
    """No floor in seconds: 3 ms of excess on a 20 ms step is 15% of it, every step."""
    watch = StragglerWatch(pp_of_rank=[0, 0, 0, 0], threshold=1.2)
    found = [watch.update([0.006, 0.006, 0.009, 0.006], 0.02) for _ in range(9)]
    assert [[s.rank for s in f] for f in found] == [[]] * 8 + [[2]]


def test_noise_is_not_a_straggler():
    """Stage 1 is heavier, not slow; slow steps that move between ranks, or one rank slow in 5
    of 8 steps, are noise; an excess under 10% of the step is not named."""
    watch = StragglerWatch(pp_of_rank=[0, 0, 1, 1], threshold=1.2)
    steps = [[1.0, 1.1, 3.0, 3.2], [1.9, 1.0, 3.0, 3.0], [1.0, 1.9, 3.0, 3.0],
             [2.3, 1.0, 3.0, 3.0], [1.9, 1.0, 3.0, 3.0], [1.0, 1.0, 3.0, 3.0],
             [1.9, 1.0, 3.0, 3.0], [1.0, 1.0, 3.0, 4.0]]
    assert [watch.update(s, 4.0) for s in steps] == [[]] * 8
    small = StragglerWatch(pp_of_rank=[0, 0, 0], threshold=1.2, min_slow=1)
    assert small.update([0.10, 0.10, 0.14], 1.0) == []  # 40 ms: under 5% of a 1 s step
    big = StragglerWatch(pp_of_rank=[0, 0, 0], threshold=1.2, min_slow=1)
    assert [s.rank for s in big.update([1.0, 1.0, 1.4], 2.0)] == [2]


def test_rank_times_log_writes_a_line_per_step_and_summarises(tmp_path):
    log = RankTimesLog(tmp_path / "rank_times.jsonl", [0, 0, 0], threshold=1.2)
    waits = {"dp": [0.1, 0.5, 0.0], "cp": [0.0] * 3, "tp": [0.0] * 3, "pp": [0.0] * 3,
             "ep": [0.0] * 3, "other": [0.0] * 3}
    for step in range(1, 10):
        summary, found = log.add(step, [1.0, 1.0, 2.0], waits, 2.5)
    log.close()
    assert [s.rank for s in found] == [2]
    assert summary == step_summary([1.0, 1.0, 2.0], waits, peer_sets([0, 0, 0]))
    assert summary["slowest_rank"] == {"rank": 2, "compute_s": 2.0, "ratio": 2.0}
    assert summary["max_wait_s"] == {"dp": 0.5, "cp": 0.0, "tp": 0.0, "pp": 0.0, "ep": 0.0,
                                     "other": 0.0}
    lines = [json.loads(line) for line in (tmp_path / "rank_times.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 10))
    assert lines[0]["wait_s"]["dp"] == [0.1, 0.5, 0.0]


def test_threshold_zero_turns_the_warning_off(tmp_path):
    log = RankTimesLog(tmp_path / "t.jsonl", [0, 0], threshold=0)
    waits = {axis: [0.0, 0.0] for axis in ("dp", "cp", "tp", "pp", "ep", "other")}
    assert all(log.add(step, [1.0, 9.0], waits, 10.0)[1] == [] for step in range(5))
    log.close()


def test_a_rank_of_a_context_parallel_layout_is_named_with_its_cp_coordinate():
    from hybrid.diagnosis.stall import who

    layout = Layout(cp=2, tp=2)
    assert who(3, layout.coords, lambda rank: 0) == "rank 3 (dp 0, cp 1, tp 1, pp 0, node 0)"
