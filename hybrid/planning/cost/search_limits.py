"""What the user's cluster and software fix, that the layout search must not change (pure:
no torch): ``search.keep`` holds settings at the config's values, ``search.schedules`` limits
the pipeline schedules, and ``cost.software``'s profile offers only what it can run. The
search applies them while it enumerates, before anything is priced, so its pruning and its
exactness for any ``search.top`` are those of the unconstrained search over fewer layouts
(``tests/test_search_limits.py``: the best equals the best of a full search filtered by hand).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from hybrid.errors import UserError
from hybrid.planning.config import Config
from hybrid.planning.cost.software import HYBRID, Software
from hybrid.planning.schedules import SCHEDULES

KEEPABLE = {"parallel.dp": "dp", "parallel.cp": "cp", "parallel.tp": "tp",
            "parallel.pp": "pp", "parallel.vpp": "vpp", "parallel.ep": "ep",
            "parallel.schedule": "schedule", "parallel.zero": "zero",
            "parallel.sequence_parallel": "sequence_parallel",
            "train.micro_batch": "micro_batch", "model.recompute": "recompute"}
"""``search.keep``'s keys and the search's settings they hold."""


class SearchLimitError(UserError):
    """``search.keep`` or ``search.schedules`` names what the search cannot hold, or holds a
    value the chosen software cannot run."""


@dataclass(frozen=True)
class SearchLimits:
    software: Software = HYBRID
    kept: dict = field(default_factory=dict)
    """Search settings key -> the only value the search may give it."""
    schedules: Optional[tuple[str, ...]] = None

    def allows(self, key: str, value) -> bool:
        """Whether a layout may have setting ``key`` (a ``settings_of`` key) at ``value``."""
        if key in self.kept and self.kept[key] != value:
            return False
        if key == "schedule" and self.schedules is not None and value not in self.schedules:
            return False
        return self.software.allows(key, value)

    def allows_zero(self, stage: int, pp: int) -> bool:
        """Whether a layout of ``pp`` stages may run ZeRO ``stage`` (the software may run
        fewer stages with a pipeline than without)."""
        return self.allows("zero", stage) and self.software.allows_zero(stage, pp)

    def only(self, key: str, values: Iterable) -> list:
        return [v for v in values if self.allows(key, v)]


NONE = SearchLimits()


def search_limits(cfg: Config, software: Software = HYBRID, keep: Iterable[str] = (),
                  schedules: Optional[Iterable[str]] = None) -> SearchLimits:
    """The limits of a search for ``cfg``: the ``keep`` keys at ``cfg``'s values, the
    ``schedules`` named, and what ``software`` runs; what cannot hold is refused in one line."""
    kept = {}
    for key in keep:
        if key not in KEEPABLE:
            raise SearchLimitError(f"search.keep names {key!r}, which the search does not "
                                   f"set; choose among {', '.join(KEEPABLE)}")
        section, name = key.split(".")
        kept[KEEPABLE[key]] = getattr(getattr(cfg, section), name)
    if schedules is not None:
        unknown = [s for s in schedules if s not in SCHEDULES]
        if unknown:
            raise SearchLimitError(f"search.schedules names {', '.join(unknown)}, not a "
                                   f"schedule; choose among {', '.join(SCHEDULES)}")
        schedules = tuple(schedules)
        if not any(software.allows("schedule", s) for s in schedules):
            raise SearchLimitError(
                f"search.schedules={list(schedules)} has none that cost.software="
                f"{software.name} runs; choose among {', '.join(software.schedules or ())}")
    for name, value in kept.items():
        if not software.allows(name, value):
            key = next(k for k, v in KEEPABLE.items() if v == name)
            raise SearchLimitError(f"search.keep holds {key}={value}, which cost.software="
                                   f"{software.name} does not run; drop it from search.keep "
                                   f"or set {key} to what that software runs")
    return SearchLimits(software=software, kept=kept, schedules=schedules)


def describe(limits: SearchLimits) -> str:
    """What the search was limited to, for its header ('' when nothing is)."""
    parts = [f"{k}={v}" for k, v in limits.kept.items()]
    if limits.schedules is not None:
        parts.append(f"schedules {','.join(limits.schedules)}")
    return ("; kept " + ", ".join(parts)) if parts else ""
