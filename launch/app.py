"""What every Hydra entry point shares: the schema registration and the DictConfig boundary.

``hybrid/`` never sees a DictConfig: ``to_dataclass`` turns the composed config into the plain
dataclasses of ``hybrid.config`` right at the edge.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from hybrid.config import Config, PlanConfig

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
USER_ERROR_EXIT = 2

T = TypeVar("T", bound=Config)


def register_schemas() -> None:
    """Register the typed schema under the names ``conf/*.yaml`` list in their defaults."""
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    store.store(name="plan_schema", node=PlanConfig)


def to_dataclass(cfg: DictConfig, cls: type[T]) -> T:
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, cls), f"composed config is {type(obj).__name__}, expected {cls.__name__}"
    return obj


def exit_user_error(err: Exception) -> NoReturn:
    """One line on stderr, no traceback, exit status 2: the contract for every user error."""
    message = " ".join(str(err).split("\n"))
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USER_ERROR_EXIT)
