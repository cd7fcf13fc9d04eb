"""The stage map: which pipeline rank runs each virtual stage (pure; no torch).

Virtual stage ``s`` (model order, ``0 <= s < pp * vpp``) runs on one pipeline rank; a rank's
stages, in model order, are its chunks 0, 1, ... The map is the one thing the checker, the
simulator, the lowering, the per-rank plan, the job plan and the runtime consult for it
(``stage_rank``, ``stage_chunk``, ``rank_stages``). It is either

- a **named rule**, ``(stage, pp) -> rank``, registered with ``register_stage_rule`` and named by
  a schedule's ``ScheduleSpec.placement``: ``loop`` (Megatron's interleaved placement, rank
  ``s % pp``) and ``v`` (ZB-V's and DualPipeV's: odd chunks run the ranks backwards, so with
  ``vpp == 2`` rank ``r`` holds stages ``r`` and ``2*pp - 1 - r``) are built in, and a schedule
  module may register its own shape beside its schedule; or
- a **``StageMap``**: any explicit stage -> rank table (``StageMap((0, 1, 1, 0))``), which
  every function that takes a ``placement`` accepts in place of a name.

Every rank must hold the same number (``vpp``) of stages; a map that does not is refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Union

from hybrid.planning.schedules.errors import ScheduleError

StageRule = Callable[[int, int], int]
"""``(stage, pp) -> rank``: a named stage map, for any number of stages."""

LOOP, V_SHAPE = "loop", "v"


def _loop(stage: int, pp: int) -> int:
    return stage % pp


def _v_shape(stage: int, pp: int) -> int:
    return pp - 1 - stage % pp if (stage // pp) % 2 else stage % pp


STAGE_RULES: dict[str, StageRule] = {LOOP: _loop, V_SHAPE: _v_shape}
"""Every named stage map, by name (``ScheduleSpec.placement`` names one)."""


def register_stage_rule(name: str, rule: StageRule) -> str:
    """Make the stage map ``rule`` known as ``name`` (for a schedule's ``placement``). The
    first stage (the embedding) must be on rank 0, as the trainer's groups assume."""
    moved = [pp for pp in range(1, 9) if rule(0, pp) != 0]
    if moved:
        raise ScheduleError(f"stage map {name!r} puts stage 0 on rank {rule(0, moved[0])} for "
                            f"pp={moved[0]}; keep the first stage on rank 0")
    STAGE_RULES[name] = rule
    _rank_table.cache_clear()
    return name


def placement_names() -> tuple[str, ...]:
    return tuple(STAGE_RULES)


@dataclass(frozen=True)
class StageMap:
    """An explicit stage -> pipeline rank table, in model order."""

    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(self.ranks))
        if not self.ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0
                                 for r in self.ranks):
            raise ScheduleError(f"stage map {list(self.ranks)} must list one rank >= 0 per "
                                f"stage, e.g. StageMap((0, 1, 1, 0))")
        pp = max(self.ranks) + 1
        held = [self.ranks.count(r) for r in range(pp)]
        if len(set(held)) != 1:
            raise ScheduleError(f"stage map {list(self.ranks)} gives ranks 0..{pp - 1} "
                                f"{held} stages; every rank must hold the same number")

    @property
    def pp(self) -> int:
        return max(self.ranks) + 1

    @property
    def vpp(self) -> int:
        return len(self.ranks) // self.pp

    def __str__(self) -> str:
        return "map:" + ",".join(map(str, self.ranks))


Placement = Union[str, StageMap]
"""A named stage map (``STAGE_RULES``) or an explicit ``StageMap``."""


def stage_map(placement: Placement, pp: int, vpp: int) -> StageMap:
    """``placement`` as an explicit table of ``pp * vpp`` stages (checked against both)."""
    table = StageMap(_rank_table(placement, pp, vpp)) if isinstance(placement, str) \
        else placement
    if len(table.ranks) != pp * vpp or table.pp != pp:
        raise ScheduleError(f"stage map {table} has {len(table.ranks)} stages on "
                            f"{table.pp} ranks; this schedule needs pp={pp} x vpp={vpp}")
    return table


@functools.lru_cache(maxsize=256)
def _rank_table(name: str, pp: int, vpp: int) -> tuple[int, ...]:
    rule = _rule(name)
    return tuple(rule(s, pp) for s in range(pp * vpp))


def _rule(name: str) -> StageRule:
    try:
        return STAGE_RULES[name]
    except KeyError:
        raise ScheduleError(f"unknown placement {name!r}; use one of {placement_names()} "
                            f"or a StageMap") from None


def stage_rank(stage: int, pp: int, placement: Placement = LOOP) -> int:
    """The pipeline rank that holds virtual stage ``stage``."""
    if isinstance(placement, StageMap):
        return placement.ranks[stage]
    return _rule(placement)(stage, pp)


def stage_chunk(stage: int, pp: int, placement: Placement = LOOP) -> int:
    """Which of its rank's chunks (0 .. vpp-1) ``stage`` is: the count of earlier stages on
    the same rank (``stage // pp`` for ``loop`` and ``v``)."""
    if placement in (LOOP, V_SHAPE):
        return stage // pp
    here = stage_rank(stage, pp, placement)
    return sum(1 for s in range(stage) if stage_rank(s, pp, placement) == here)


def rank_stages(rank: int, pp: int, vpp: int, placement: Placement = LOOP) -> list[int]:
    """The virtual stages pipeline rank ``rank`` holds, by chunk (model order)."""
    table = stage_map(placement, pp, vpp)
    return [s for s, r in enumerate(table.ranks) if r == rank]
