"""The ``Launcher`` protocol and its registry: how ``launcher.name`` becomes a way to start
the ranks (``local``, ``torchrun``, ``slurm``: one module each, registering its class).

A launcher says what it needs of the config before anything starts (``config_problem``: one
line with the fix, or None), whether this machine can start it (``check_here``: raises a
``UserError``), and starts the ranks of a prepared plan (``launch``: the ranks' results, or
None when it left them running, as a Slurm job submitted without waiting). ``runs_here``
says whether this machine's memory and devices are the job's. A new launcher is one module
that defines such a class and calls ``register_launcher``; ``launcher.name`` accepts every
registered name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence

from hybrid.planning.layout import LayoutError


class Launcher(Protocol):
    name: str
    runs_here: bool

    def config_problem(self, cfg) -> Optional[str]:
        """What it needs of ``launcher.*`` (and the rest) that the config lacks, in one line."""

    def check_here(self, plan) -> None:
        """Raise a ``UserError`` when this machine cannot start the job."""

    def launch(self, entrypoint: Callable[..., Any], args: Sequence[Any], plan, run_dir: Path,
               **options: Any) -> Optional[list]:
        """Start ``entrypoint(*args)`` on every rank of ``plan``; their results by rank."""


LAUNCHERS: dict[str, type] = {}
BUILT_IN = ("local", "torchrun", "slurm")
"""The built-in launchers, in the order messages name them (whichever was imported first)."""


def register_launcher(cls: type) -> type:
    """Make a launcher class known by its ``name`` (a class decorator)."""
    LAUNCHERS[cls.name] = cls
    return cls


def launcher_names() -> list[str]:
    """The registered names: the built-in ones in ``BUILT_IN``'s order, then the others in
    the order they registered (so a message does not depend on which module was imported
    first)."""
    return sorted(LAUNCHERS, key=lambda name: BUILT_IN.index(name) if name in BUILT_IN
                  else len(BUILT_IN))


def launcher_for(name: str) -> Launcher:
    """The registered launcher ``launcher.name`` names; ``LayoutError`` (one line) if none."""
    if name not in LAUNCHERS:
        raise LayoutError(f"launcher.name={name!r} is unknown; choose one of "
                          f"{', '.join(launcher_names())}")
    return LAUNCHERS[name]()
