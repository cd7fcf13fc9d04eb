"""Pipeline actions: the small values that a schedule is made of (no torch).

A schedule is ``list[list[Action]]``: one ordered list per pipeline rank. Which rank runs
virtual stage ``s`` is the stage map's (``stage_map``: ``loop``, ``v`` or any other shape).

Text form, as in torch.distributed.pipelining: ``<stage><KIND><micro-batch>``, e.g. ``2F0``,
``1I3``, ``0W3``, ``1B2``, ``2SEND_F0``, ``3RECV_B1``, and under ZeRO-3 ``0UNSHARD3`` /
``0RESHARD3`` (open / close stage 0's span of gathered weights, for and after micro-batch 3's
compute; see ``gathers``). A ``Composite`` (``0F3+3B1``) is an ordered group of compute
actions run as one (DualPipeV's overlapped F and B). ``parse_step`` and ``str`` round-trip,
and so do ``to_text``/``from_text`` and ``dump_csv``/``load_csv`` for whole schedules.
"""

from __future__ import annotations

import csv
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional
from hybrid.planning.schedules.errors import ScheduleError
from hybrid.planning.schedules.stage_map import (  # noqa: F401  (importable from here too)
    LOOP, V_SHAPE, rank_stages, stage_chunk, stage_rank,
)

FORWARD = "F"
BACKWARD = "B"  # full backward: input gradient and weight gradient together
BACKWARD_INPUT = "I"  # input gradient only (zero-bubble split)
BACKWARD_WEIGHT = "W"  # weight gradient only (zero-bubble split)
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
UNSHARD, RESHARD = "UNSHARD", "RESHARD"  # ZeRO-3: gather a stage's weights, release them

COMPUTE_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
SHARD_KINDS = (UNSHARD, RESHARD)
ALL_KINDS = COMPUTE_KINDS + COMM_KINDS + SHARD_KINDS



@dataclass(frozen=True)
class ActionKind:
    """A kind of action a user adds to the IR (``register_action_kind``): a step of its own
    rank, run in list order, that moves no data between ranks and takes no pipeline time (a
    marker, a hook: a per-stage optimizer step, a memory snapshot). The checker holds it to
    its stage's rank, once per (stage, micro-batch), after ``after`` of the same pair; the
    simulator and the lowering pass over it; the runtime calls ``run(stage, mb)``."""

    name: str
    after: Optional[str] = None
    """The built-in compute kind (F, B, I or W) of the same stage and micro-batch it must
    follow on its rank; None: anywhere in the rank's list."""
    run: Optional[Callable[[int, int], None]] = None
    """What the runtime calls for it, with the action's stage and micro-batch (None: nothing,
    a marker only)."""
    doc: str = ""


EXTRA_KINDS: dict[str, ActionKind] = {}
"""The kinds registered beside the built-in ones (``ALL_KINDS``), by name."""


def register_action_kind(name: str, *, after: Optional[str] = None,
                         run: Optional[Callable[[int, int], None]] = None,
                         doc: str = "") -> ActionKind:
    """Add action kind ``name`` to the schedule IR (see ``ActionKind``); a second
    registration of a name replaces the first. Its text form is ``<stage><name><mb>``."""
    if not re.fullmatch(r"[A-Z][A-Z_]*", name) or name in ALL_KINDS:
        raise ScheduleError(f"action kind {name!r} must be upper-case letters and _ and not "
                            f"a built-in kind ({', '.join(ALL_KINDS)}); e.g. STEP_OPT")
    if after is not None and after not in COMPUTE_KINDS:
        raise ScheduleError(f"action kind {name!r}: after={after!r} must be one of "
                            f"{COMPUTE_KINDS} or None")
    EXTRA_KINDS[name] = ActionKind(name, after, run, doc)
    _action_pattern.cache_clear()
    return EXTRA_KINDS[name]


def action_kinds() -> tuple[str, ...]:
    """Every kind an action may have: the built-in ones, then the registered ones."""
    return ALL_KINDS + tuple(EXTRA_KINDS)


@functools.lru_cache(maxsize=None)
def _action_pattern() -> re.Pattern:
    # Longest kinds first, so that "SEND_F" is never read as "S" + ...; anchored on both ends.
    kinds = sorted(action_kinds(), key=len, reverse=True)
    return re.compile(r"^(\d+)(" + "|".join(map(re.escape, kinds)) + r")(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one pipeline rank: ``kind`` of virtual ``stage`` for micro-batch ``mb``."""

    stage: int
    kind: str
    mb: int

    def __post_init__(self) -> None:
        if self.kind not in ALL_KINDS and self.kind not in EXTRA_KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}; use one of "
                                f"{action_kinds()} or register it (register_action_kind)")
        if self.stage < 0 or self.mb < 0:
            raise ScheduleError(f"action {self} has a negative stage or micro-batch")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``"2F0"`` -> ``Action(stage=2, kind="F", mb=0)``."""
        match = _action_pattern().match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot read action {text!r}; write <stage><kind><micro-batch> like 2F0 or "
                f"3RECV_B1, with kind in {action_kinds()}"
            )
        stage, kind, mb = match.groups()
        return cls(int(stage), kind, int(mb))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_shard(self) -> bool:
        """A ZeRO-3 gather or release of the stage's weights (``gathers``)."""
        return self.kind in SHARD_KINDS

    @property
    def is_extra(self) -> bool:
        """A registered kind's action (``register_action_kind``): local, run in list order."""
        return self.kind in EXTRA_KINDS

    @property
    def is_backward_input(self) -> bool:
        """True for the actions that produce the input gradient (B or I)."""
        return self.kind in (BACKWARD, BACKWARD_INPUT)


@dataclass(frozen=True)
class Composite:
    """An ordered group of compute actions run as one step of a rank: DualPipeV's overlapped
    pair, one micro-batch's forward of one chunk and another's backward of the other chunk.

    Text form: the parts joined by ``+``, e.g. ``0F3+3B1``. On CPU (and in the checker and
    the simulator, which see ``flatten``'s lists) a composite is its parts in order. On a GPU
    the parts would run on two streams, each part's communication under the other's compute,
    the composite ending when both have: its RECVs all posted before it, its SENDs after
    (docs/pipeline.md, "Composite actions": designed, not built).
    """

    parts: tuple[Action, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or not all(isinstance(p, Action) and p.is_compute
                                          for p in self.parts):
            raise ScheduleError(f"composite {'+'.join(map(str, self.parts))} needs two or more "
                                f"compute actions (F, B, I, W)")

    def __str__(self) -> str:
        return "+".join(map(str, self.parts))

    is_compute, is_comm, is_shard, is_extra = True, False, False, False


def parse_step(text: str) -> Action | Composite:
    """``"2F0"`` -> an ``Action``; ``"0F3+3B1"`` -> a ``Composite`` of its parts."""
    words = text.strip().split("+")
    if len(words) == 1:
        return Action.parse(words[0])
    return Composite(tuple(Action.parse(word) for word in words))


def flatten(lists: list[list]) -> list[list[Action]]:
    """Each composite replaced by its parts in order: what the checker, the simulator, the
    lowering and the CPU runtime run."""
    return [[part for step in steps
             for part in (step.parts if isinstance(step, Composite) else (step,))]
            for steps in lists]


def check_and_strip_extras(lists: list[list[Action]]) -> list[list[Action]]:
    """The lists without their registered kinds' actions (``register_action_kind``), after
    checking that each appears once and after its ``after`` action of its rank; what is left
    is checked and replayed as before (they move no data and take no time)."""
    if not EXTRA_KINDS or not any(a.is_extra for actions in lists for a in actions):
        return lists
    for rank, actions in enumerate(lists):
        seen: set[Action] = set()
        for action in actions:
            spec = EXTRA_KINDS.get(action.kind)
            if spec is not None and action in seen:
                raise ScheduleError(f"rank {rank} runs {action} twice; a {spec.name} runs "
                                    f"once per stage and micro-batch")
            if spec is not None and spec.after is not None:
                needed = Action(action.stage, spec.after, action.mb)
                if needed not in seen:
                    raise ScheduleError(f"rank {rank}: {action} runs before {needed}; move it "
                                        f"after (a {spec.name} follows its {spec.after})")
            seen.add(action)
    return [[a for a in actions if not a.is_extra] for actions in lists]


# ----- whole schedules as text and CSV -------------------------------------------------------
def to_text(lists: list[list[Action]]) -> str:
    """One line per rank, ``rank 0: 0F0 0F1 0B0 ...``; read back with ``from_text``."""
    return "".join(f"rank {rank}: {' '.join(map(str, actions))}".rstrip() + "\n"
                   for rank, actions in enumerate(lists))


def from_text(text: str) -> list[list[Action]]:
    """The inverse of ``to_text``; lines must be ``rank <r>: <actions>`` in rank order."""
    lists: list[list[Action]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        head, sep, body = line.partition(":")
        if not sep or head.strip() != f"rank {len(lists)}":
            raise ScheduleError(
                f"schedule text line {line!r} should start with 'rank {len(lists)}:'"
            )
        lists.append([parse_step(word) for word in body.split()])
    return lists


def dump_csv(lists: list[list[Action]], path: str | Path) -> None:
    """One CSV row per rank, one action text per cell."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        for actions in lists:
            writer.writerow([str(action) for action in actions])


def load_csv(path: str | Path) -> list[list[Action]]:
    """The inverse of ``dump_csv``; an empty row is a rank with no actions."""
    with open(path, newline="") as handle:
        return [[parse_step(cell) for cell in row if cell.strip()]
                for row in csv.reader(handle)]

