"""Chrome traces, PNG timelines and the bubble measured from events."""

import json
from fractions import Fraction as Fr

import pytest

from hybrid.planning.schedules import add_communication, build_schedule
from hybrid.planning.schedules.simulate import Costs, simulate
from hybrid.pipeline.timeline import draw_timeline, measured_bubble, write_chrome_trace


def _simulated(name="1f1b", p=4, m=8, v=1, lowered=False, costs=Costs()):
    lists = build_schedule(name, p, m, v)
    if lowered:
        lists = add_communication(lists, p, v)
    return simulate(lists, p, m, v, costs)


def test_chrome_trace_loads_back_with_one_event_per_action(tmp_path):
    result = _simulated(lowered=True)
    write_chrome_trace(result.events, tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())
    complete = [event for event in trace["traceEvents"] if event["ph"] == "X"]
    assert len(complete) == len(result.events)
    rank, action, start, end = result.events[5]
    event = complete[5]
    assert event["name"] == str(action) and event["tid"] == rank and event["pid"] == 0
    assert event["ts"] == pytest.approx(start * 1e6)
    assert event["dur"] == pytest.approx((end - start) * 1e6)
    assert event["args"] == {"kind": action.kind, "stage": action.stage, "mb": action.mb}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {f"pp rank {r}" for r in range(4)}  # pipeline ranks, not global ones


def test_chrome_trace_accepts_action_texts(tmp_path):
    write_chrome_trace([(0, "0F0", 0.0, 0.5), (1, "1I0", 0.5, 1.0)], tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert [e["args"]["kind"] for e in events if e["ph"] == "X"] == ["F", "I"]


@pytest.mark.parametrize("name,v,lowered", [("1f1b", 1, False), ("zb-h1", 1, True),
                                            ("interleaved-1f1b", 2, True)])
def test_draw_timeline_writes_a_real_png(tmp_path, name, v, lowered):
    costs = Costs(F=Fr(1), B=Fr(2), I=Fr(1), W=Fr(1), p2p=Fr(1, 10))  # exact times draw too
    result = _simulated(name, 4, 8, v, lowered, costs.per_chunk(v))
    path = tmp_path / "timeline.png"
    draw_timeline(result.events, path, title=f"{name} pp=4 m=8", pp=4)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000


def test_the_pictures_rows_are_named_as_pipeline_ranks():
    """Each row is a rank of the pipeline group, which a global rank number would misname
    once tp, cp or dp > 1."""
    from hybrid.pipeline.timeline import timeline_figure

    costs = Costs(F=Fr(1), B=Fr(2), I=Fr(1), W=Fr(1), p2p=Fr(1, 10))
    result = _simulated("1f1b", 2, 4, 1, True, costs.per_chunk(1))
    labels = [tick.get_text() for tick in timeline_figure(result.events).axes[0].get_yticklabels()]
    assert [label.split(" (")[0] for label in labels] == ["pp rank 0", "pp rank 1"]
    assert all(label.endswith("% idle)") for label in labels)


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (8, 32)])
def test_the_legend_clears_the_title_and_no_bar_is_cut_off(pp, m):
    """On the drawn extents (display coordinates), narrow figures and wide ones: the legend
    overlaps neither the title nor the plot and stays inside the figure, and the last
    backward bar ends inside the plot's frame."""
    from hybrid.pipeline.timeline import timeline_figure

    costs = Costs(F=Fr(1), B=Fr(2), I=Fr(1), W=Fr(1), p2p=Fr(1, 10))
    result = _simulated("1f1b", pp, m, 1, True, costs.per_chunk(1))
    figure = timeline_figure(result.events, title=f"1f1b pp={pp} m={m}", pp=pp, unit="s")
    renderer = figure.canvas.get_renderer()
    axes = figure.axes[0]
    title, legend = axes.title.get_window_extent(renderer), axes.get_legend().get_window_extent(
        renderer)
    frame, whole = axes.get_window_extent(renderer), figure.bbox
    assert not title.overlaps(legend) and not legend.overlaps(frame)
    assert whole.x0 <= legend.x0 and legend.x1 <= whole.x1 and legend.y1 <= whole.y1
    assert whole.x0 <= title.x0 and title.x1 <= whole.x1 and title.y1 <= whole.y1
    right = max(bar.get_window_extent(renderer).x1 for bar in axes.patches)
    assert right < frame.x1


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                                    ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("lowered", [False, True])
def test_measured_bubble_of_simulated_events_is_the_simulators(name, v, lowered):
    costs = Costs(F=Fr(1), B=Fr(2), I=Fr(1), W=Fr(1), p2p=Fr(1, 3))
    result = _simulated(name, 4, 8, v, lowered, costs)
    assert tuple(measured_bubble(result.events)) == result.bubble_per_rank


def test_measured_bubble_starts_the_clock_at_the_first_event():
    events = [(0, "0F0", 10.0, 12.0), (1, "1RECV_F0", 10.0, 12.0), (1, "1F0", 12.0, 14.0)]
    assert measured_bubble(events) == [0.5, 0.5]  # a RECV's wait is not busy time
