"""Pictures and traces of pipeline timelines, from the simulator or from a real run.

An event is ``(rank, action, start_s, end_s)``; ``action`` is an ``Action`` or its text
(``"2F0"``). Times are in seconds (a simulator's abstract unit is read as one second).
``write_chrome_trace`` writes JSON that Perfetto and chrome://tracing load;
``draw_timeline`` writes a PNG; ``measured_bubble`` gives each rank's idle fraction.

matplotlib is used through its Agg canvas directly, so no global pyplot state is touched and
no display is needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from hybrid.files import atomic_write, write_text

from hybrid.planning.schedules.actions import (
    BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECV_B, RECV_F, Action,
)

EventLike = tuple[int, "Action | str", float, float]
Event = tuple[int, Action, float, float]

KIND_COLOURS = {
    FORWARD: "#4C72B0",  # blue
    BACKWARD: "#55A868",  # green
    BACKWARD_INPUT: "#DD8452",  # orange
    BACKWARD_WEIGHT: "#8172B3",  # purple
}
KIND_LABELS = {FORWARD: "F forward", BACKWARD: "B backward", BACKWARD_INPUT: "I input grad",
               BACKWARD_WEIGHT: "W weight grad"}
WAIT_COLOUR = "#999999"
MICROSECONDS_PER_SECOND = 1e6


def rank_label(rank: int) -> str:
    """A row's name: the rank within the pipeline group ("pp rank 1"), which is not the
    global rank once tp, cp or dp > 1 (a trace from rank 0 of pp=2, tp=2 shows global ranks
    0 and 2 as pp ranks 0 and 1)."""
    return f"pp rank {rank}"


def normalise_events(events: Iterable[EventLike]) -> list[Event]:
    """Parse action texts, so that the rest of this module sees ``Action`` values only."""
    return [(int(rank), action if isinstance(action, Action) else Action.parse(action),
             start, end) for rank, action, start, end in events]


def measured_bubble(events: Iterable[EventLike]) -> list[float]:
    """Per rank: (makespan - compute time) / makespan, the makespan taken over all ranks.

    Only F/B/I/W count as busy: a RECV's length is time spent waiting.
    """
    parsed = normalise_events(events)
    if not parsed:
        return []
    begin = min(start for _, _, start, _ in parsed)
    makespan = max(end for _, _, _, end in parsed) - begin
    busy = [0] * (max(rank for rank, _, _, _ in parsed) + 1)  # int 0 keeps Fractions exact
    for rank, action, start, end in parsed:
        if action.is_compute:
            busy[rank] += end - start
    return [(makespan - b) / makespan if makespan else 0.0 for b in busy]


def write_chrome_trace(events: Iterable[EventLike], path: str | Path) -> None:
    """Chrome trace JSON: one complete ("X") event per action, ``tid`` = pipeline rank."""
    parsed = normalise_events(events)
    ranks = sorted({rank for rank, _, _, _ in parsed})
    trace = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "pipeline"}}]
    trace += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
               "args": {"name": rank_label(rank)}} for rank in ranks]
    trace += [{
        "name": str(action), "cat": action.kind, "ph": "X", "pid": 0, "tid": rank,
        "ts": start * MICROSECONDS_PER_SECOND,
        "dur": (end - start) * MICROSECONDS_PER_SECOND,
        "args": {"kind": action.kind, "stage": action.stage, "mb": action.mb},
    } for rank, action, start, end in parsed]
    write_text(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))


TITLE_PAD = 18
"""Points between the plot and the title: the legend's row."""
RIGHT_MARGIN = 0.01
"""The x-axis runs to the makespan plus this share of it."""


def draw_timeline(events: Iterable[EventLike], path: str | Path, title: str = "pipeline",
                  pp: int | None = None, unit: str = "") -> None:
    """A PNG with one row per pipeline rank (pp rank 0 on top), bars coloured by kind, gaps = idle.

    Micro-batch numbers are written on the bars wide enough to hold them; RECV waits are thin
    grey bars; the mean bubble is in the title and each rank's bubble in its row label. Given
    ``pp``, later virtual chunks (stage // pp) are drawn in lighter shades of their kind.
    ``unit`` names the time unit on the axis ("s" for a real run; none for simulated costs).
    """
    figure = timeline_figure(events, title, pp, unit)
    with atomic_write(path) as tmp:
        figure.savefig(tmp, dpi=120, format=Path(path).suffix.lstrip(".") or "png")


def timeline_figure(events: Iterable[EventLike], title: str = "pipeline",
                    pp: int | None = None, unit: str = ""):
    """The figure ``draw_timeline`` saves (a matplotlib ``Figure``, laid out)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    parsed = normalise_events(events)
    bubbles = [float(bubble) for bubble in measured_bubble(parsed)]  # Fractions format badly
    n_ranks = len(bubbles)
    begin = min((start for _, _, start, _ in parsed), default=0)
    makespan = float(max((end for _, _, _, end in parsed), default=1) - begin)
    figure = Figure(figsize=(min(24, 8 + len(parsed) / 40), 1.2 + 0.55 * n_ranks))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    kinds_drawn = _draw_bars(axes, parsed, begin, makespan or 1, pp)
    axes.set_yticks(range(n_ranks),
                    [f"{rank_label(rank)} ({bubble:.0%} idle)"
                     for rank, bubble in enumerate(bubbles)])
    axes.set_ylim(max(n_ranks, 1) - 0.5, -0.5)  # rank 0 on top
    # A little room right of the makespan: the last bar's edge is not cut by the frame.
    axes.set_xlim(0, (makespan or 1) * (1 + RIGHT_MARGIN))
    axes.set_xlabel(f"time ({unit})" if unit else "time")
    mean = sum(bubbles) / n_ranks if n_ranks else 0.0
    axes.set_title(f"{title}: bubble {mean:.1%}, makespan {makespan:.3g}{unit and ' ' + unit}",
                   loc="left", fontsize=10, pad=TITLE_PAD)
    _draw_legend(axes, kinds_drawn)
    figure.tight_layout()
    return figure


def _draw_bars(axes, parsed: Sequence[Event], begin: float, makespan: float,
               pp: int | None) -> list[str]:
    """Draw every event; returns the kinds drawn, for the legend."""
    from matplotlib.colors import to_rgb

    drawn: list[str] = []
    label_min_width = makespan / 90  # about two digits at the default width
    n_chunks = 1 + max((action.stage // pp for _, action, _, _ in parsed), default=0) if pp else 1
    for rank, action, start, end in parsed:
        width = end - start
        if action.kind in KIND_COLOURS:
            # mix towards white by chunk, so that chunks of one rank tell apart
            lighten = 0.5 * (action.stage // pp) / (n_chunks - 1) if n_chunks > 1 else 0.0
            colour = tuple(c + (1 - c) * lighten for c in to_rgb(KIND_COLOURS[action.kind]))
            axes.barh(rank, width, left=start - begin, height=0.8,
                      color=colour, edgecolor="white", linewidth=0.5)
            if width >= label_min_width:
                axes.text(start - begin + width / 2, rank, str(action.mb), ha="center",
                          va="center", fontsize=7, color="white")
            kind = action.kind
        elif action.kind in (RECV_F, RECV_B) and width > 0:
            axes.barh(rank, width, left=start - begin, height=0.12, color=WAIT_COLOUR)
            kind = "wait"
        else:
            continue  # a SEND takes no rank time: nothing to see
        if kind not in drawn:
            drawn.append(kind)
    return drawn


def _draw_legend(axes, kinds_drawn: list[str]) -> None:
    from matplotlib.patches import Patch

    order = [FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, "wait"]
    handles = [Patch(color=KIND_COLOURS.get(kind, WAIT_COLOUR),
                     label=KIND_LABELS.get(kind, "wait for RECV"))
               for kind in order if kind in kinds_drawn]
    # A row of its own between the plot and the title (the title is raised to make room):
    # beside the title, on the same line, it covered the makespan on narrow figures.
    axes.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0),
                borderaxespad=0.1, ncol=len(handles) or 1, fontsize=8, frameon=False)
