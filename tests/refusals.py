"""What hybrid-train refuses a config with, decided in the test's own process."""

from __future__ import annotations

from pathlib import Path


def refusal_in_process(overrides: list[str], run_dir: Path) -> str:
    """The line hybrid-train refuses ``overrides`` with (``error: ...``), decided in this
    process: the command's composition (``conf/config.yaml``), its wording of composition
    errors and its checks before launch (``prepare``), without a process per case. A config
    that is not refused fails the calling test."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from hybrid.errors import UserError
    from launch.commands.app import composition_error, compose_train_config
    from launch.commands.train import prepare

    try:
        cfg = compose_train_config(overrides)
    except (HydraException, OmegaConfBaseException) as err:
        return "error: " + " ".join(composition_error(err).split("\n"))
    try:
        prepare(cfg, run_dir)
    except UserError as err:
        return "error: " + " ".join(str(err).split("\n"))
    raise AssertionError(f"hybrid-train {' '.join(overrides)} was not refused")
