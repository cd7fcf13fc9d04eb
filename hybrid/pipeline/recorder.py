"""Timelines of real pipeline steps: record every action's wall-clock span on each rank, gather
the spans to one rank, write the Chrome trace and the PNG (``timeline.py``) and compare the
measured bubble with the simulator's for the same schedule and the measured action times.

Times are ``time.time()`` seconds: comparable across the processes of one machine (and, to
clock-sync precision, across machines); the drawings start at the earliest event.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

from hybrid.comm import Group
from hybrid.files import write_text
from hybrid.planning.schedules.stage_map import Placement
from hybrid.planning.schedules.actions import COMPUTE_KINDS, LOOP, Action
from hybrid.planning.schedules.simulate import Costs, simulate
from hybrid.pipeline.timeline import draw_timeline, measured_bubble, write_chrome_trace

Event = tuple[int, Action, float, float]  # (pipeline rank, action, start_s, end_s)


class ActionRecorder:
    """Collects ``(rank, action, start_s, end_s)`` for every action the runtime runs."""

    def __init__(self, rank: int):
        self.rank = rank
        self.events: list[Event] = []

    def record(self, action: Action, start_s: float, end_s: float) -> None:
        self.events.append((self.rank, action, start_s, end_s))

    def clear(self) -> None:
        self.events = []


def gather_events(events: list[Event], group: Group, dst: int) -> Optional[list[Event]]:
    """All ranks' events on global rank ``dst`` (None elsewhere); a collective over ``group``.
    For one pipeline pass ``groups.pipeline`` and ``groups.pipeline.ranks[0]``."""
    texts = [(rank, str(action), start, end) for rank, action, start, end in events]
    gathered = group.gather_objects(texts, dst)
    if gathered is None:
        return None
    return sorted(((rank, Action.parse(text), start, end)
                   for part in gathered for rank, text, start, end in part),
                  key=lambda event: (event[0], event[2]))


def mean_costs(events: list[Event]) -> Costs:
    """Per-kind mean duration of the compute actions in ``events`` (kinds absent: 0)."""
    spans: dict[str, list[float]] = {kind: [] for kind in COMPUTE_KINDS}
    for _, action, start, end in events:
        if action.is_compute:
            spans[action.kind].append(end - start)
    mean = {kind: statistics.fmean(values) if values else 0.0 for kind, values in spans.items()}
    return Costs(F=mean["F"], B=mean["B"], I=mean["I"], W=mean["W"], p2p=0.0)


def bubble_report(events: list[Event], lists: list[list[Action]], pp: int, m: int,
                  vpp: int = 1, placement: Placement = LOOP) -> dict:
    """Measured bubble of a real step next to the simulator's for ``lists`` timed with the
    step's own mean action durations (no communication time): the difference is what
    communication and waiting cost."""
    measured = measured_bubble(events)
    simulated = simulate(lists, pp, m, vpp, costs=mean_costs(events), placement=placement)
    makespan = max(end for *_, end in events) - min(start for _, _, start, _ in events)
    return {"measured": statistics.fmean(measured), "measured_per_rank": measured,
            "simulated": simulated.bubble_fraction,
            "simulated_per_rank": list(simulated.bubble_per_rank),
            "makespan_s": makespan, "simulated_makespan_s": simulated.makespan}


def write_timeline(events: list[Event], lists: list[list[Action]], out_prefix: str | Path, *,
                   pp: int, m: int, vpp: int = 1, title: str = "pipeline",
                   placement: Placement = LOOP) -> dict:
    """Write ``<out_prefix>.json`` (Chrome trace) and ``<out_prefix>.png``; return the bubble
    report, with the two paths added."""
    prefix = Path(out_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    report = bubble_report(events, lists, pp, m, vpp, placement)
    trace, picture = prefix.with_suffix(".json"), prefix.with_suffix(".png")
    write_chrome_trace(events, trace)
    draw_timeline(events, picture, title=f"{title} (simulated {report['simulated']:.0%})", pp=pp,
                  unit="s")
    report.update(trace=str(trace), png=str(picture))
    return report


def write_step_timeline(recorder: ActionRecorder, lists: list[list[Action]], groups, run_dir: Path,
                        *, step: int, m: int, schedule: str) -> None:
    """Rank 0's pipeline writes ``timeline.json``/``.png`` and the measured bubble
    (``timeline_bubble.json``) of the step ``recorder`` recorded; every rank calls it."""
    pipeline = groups.pipeline
    events = gather_events(recorder.events, group=pipeline, dst=pipeline.ranks[0])
    if groups.world.rank() != 0:
        return
    layout = groups.layout
    report = write_timeline(events, lists, run_dir / "timeline", pp=layout.pp, m=m,
                            vpp=layout.vpp, placement=layout.stage_placement,
                            title=f"{schedule} step {step}")
    write_text(run_dir / "timeline_bubble.json", json.dumps(report, indent=1))
    print(f"timeline of step {step}: {report['png']} (bubble measured "
          f"{report['measured']:.1%}, simulated {report['simulated']:.1%})", flush=True)
