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


def hydra_compose_refusal(override: str) -> str:
    """The line Hydra's own compose of ``conf/config.yaml`` is refused with for ``override``,
    in hybrid's wording (``composition_error``): what a key in a YAML file meets, since only
    the commands' command lines rewrite the flat keys of before. Fails the calling test if
    the override composes."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from launch.commands.app import CONF_DIR, composition_error, register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        try:
            compose(config_name="config", overrides=[override])
        except HydraException as err:
            return composition_error(err)
    raise AssertionError(f"{override} composed")
