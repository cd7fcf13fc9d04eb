"""The registered launchers (importing this module registers the built-in ones, in this
order: ``local``, ``torchrun``, ``slurm``) and the two questions every entry point asks."""

from __future__ import annotations

from typing import Optional

# Each import registers its launcher; this order is the order of launcher.name's choices.
from launch.launchers import local  # noqa: I001
from launch.launchers import torchrun
from launch.launchers import slurm
from launch.launchers.launcher import LAUNCHERS, Launcher, launcher_for, launcher_names

BUILT_IN = (local, torchrun, slurm)

__all__ = ["LAUNCHERS", "Launcher", "launcher_for", "launcher_problem", "unknown_launcher"]


def unknown_launcher(cfg) -> Optional[str]:
    """The one line refusing an unregistered ``launcher.name``, or None."""
    if cfg.launcher.name not in LAUNCHERS:
        return (f"launcher.name={cfg.launcher.name!r} is unknown; choose one of "
                f"{', '.join(launcher_names())}")
    return None


def launcher_problem(cfg) -> Optional[str]:
    """What ``cfg``'s launcher refuses before anything starts: an unknown name, or a setting
    it needs (one line), or None."""
    return unknown_launcher(cfg) or launcher_for(cfg.launcher.name).config_problem(cfg)
