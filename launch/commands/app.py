"""What every Hydra entry point shares: the schema registration and the DictConfig boundary.

``hybrid/`` never sees a DictConfig: ``to_dataclass`` turns the composed config into the plain
dataclasses of ``hybrid.planning.config`` right at the edge.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn, Optional, TypeVar

from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybrid.errors import USER_ERROR_EXIT
from hybrid.planning.config import Config, PlanConfig
from hybrid.planning import dp_config, moe_config
from hybrid.files import RunDirError
from launch.launchers.failures import interrupted_by

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")

T = TypeVar("T", bound=Config)


def register_schemas() -> None:
    """Register the typed schema under the names ``conf/*.yaml`` list in their defaults."""
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    store.store(name="plan_schema", node=PlanConfig)


MOVED = {"parallel": (dp_config, "ParallelConfig", "(or choose a file of conf/parallel/dp: "
                                                   "parallel/dp=NAME)"),
         "model": (moe_config, "ModelConfig", "")}
"""Section -> the module whose ``FLAT_KEYS`` and ``new_key`` say where its flat keys of
before went (``hybrid.planning.moved_keys``), the schema class Hydra names in its error, and
where to read on."""


def new_overrides(overrides: list[str]) -> list[str]:
    """``overrides`` with the flat keys of before in their new places (``parallel.zero=3`` ->
    ``parallel.dp_strategy.zero.stage=3``, ``model.experts=4`` -> ``model.moe.experts=4``:
    ``MOVED``), so every command line written for them still runs."""
    out = []
    for text in overrides:
        sign = text[:len(text) - len(text.lstrip("+~"))]
        key, eq, value = text[len(sign):].partition("=")
        section, _, flat = key.partition(".")
        moved = MOVED.get(section)
        if moved and flat in moved[0].FLAT_KEYS:
            text = f"{sign}{section}.{moved[0].new_key(flat)}{eq}{value}"
        out.append(text)
    return out


def typed_overrides() -> list[str]:
    """The overrides typed on this command's line (Hydra's ``overrides.task``); [] outside a
    Hydra run (a config composed in-process)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def to_dataclass(cfg: DictConfig, cls: type[T]) -> T:
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, cls), f"composed config is {type(obj).__name__}, expected {cls.__name__}"
    return obj


def compose_plan_config(overrides: list[str]) -> PlanConfig:
    """``conf/plan.yaml`` with ``overrides``, as ``hybrid-plan`` composes it, in-process (for
    benchmarks and tests that plan many configs)."""
    from hydra import compose, initialize_config_dir

    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_dataclass(compose(config_name="plan", overrides=new_overrides(overrides)),
                            PlanConfig)


def compose_train_config(overrides: list[str]) -> Config:
    """``conf/config.yaml`` with ``overrides``, as ``hybrid-train`` composes it, in-process (for
    tests that check many configs without a process each). Composition errors propagate:
    ``composition_error`` words them as the command does."""
    from hydra import compose, initialize_config_dir

    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_dataclass(compose(config_name="config", overrides=new_overrides(overrides)),
                            Config)


def run_hydra_app(app: Callable[[], None]) -> None:
    """Run a ``@hydra.main`` app so that composition errors (a misspelt key, a wrong type, an
    unknown preset) follow the user-error contract too: one line, exit status 2. Errors raised
    inside the app itself keep their traceback: they are bugs, not user errors."""
    register_schemas()
    sys.argv[1:] = new_overrides(sys.argv[1:])
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let Hydra re-raise instead of printing and exiting
    try:
        app()
    except (HydraException, OmegaConfBaseException) as err:
        interrupt = interrupted_by(err)
        if interrupt is not None:  # Ctrl-C while Hydra composed: not a config error
            raise interrupt from None
        exit_user_error(composition_error(err))
    except OSError as err:  # Hydra making the run directory, or a file of the run
        exit_user_error(err if isinstance(err, RunDirError)
                        else f"cannot write the run directory: {err}; choose another with "
                             f"hydra.run.dir=...")


def composition_error(err: BaseException) -> str:
    """``Could not override 'parallel.tpp'. Key 'tpp' not in 'ParallelConfig'``; for an
    unknown preset (``model=tinyy``) the presets there are."""
    integer = integer_error(err)
    if integer is not None:
        return integer
    parts, options = [], None
    while err is not None and len(parts) < 2:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        if first and first not in parts:
            parts.append(first)
        options = options or getattr(err, "options", None)
        err = err.__cause__
    line = " ".join(parts)
    line += _moved_key(line)
    return f"{line}; choose one of: {', '.join(sorted(options))}" if options else line


def _moved_key(message: str) -> str:
    """For a flat key of before in a YAML file (``Key 'zero' not in 'ParallelConfig'``,
    ``Key 'experts' not in 'ModelConfig'``): where it lives now (the command line's are
    rewritten: ``new_overrides``)."""
    for section, (module, schema, more) in MOVED.items():
        for flat in module.FLAT_KEYS:
            if f"Key '{flat}' not in '{schema}'" in message:
                return f"; {section}.{flat} is now {section}.{module.new_key(flat)} {more}".rstrip()
    return ""


def integer_error(err: Optional[BaseException]) -> Optional[str]:
    """For a value an integer setting cannot take (``train.steps=1e3``, ``model.layers=2.0``:
    Hydra reads them as floats, which OmegaConf refuses for an int): the field, what was
    written and the integer to write; None for any other error."""
    written = str(err).split("override ", 1)[-1].split()[0] if "override " in str(err) else ""
    while err is not None:
        if "could not be converted to Integer" in str(err) and getattr(err, "full_key", None):
            key, value = err.full_key, err.value
            text = written if written.startswith(f"{key}=") else f"{key}={value}"
            if isinstance(value, float) and math.isfinite(value) and value == int(value):
                return (f"{text}: {key} takes an integer, and this reads as the float "
                        f"{value}; write {key}={int(value)}")
            if isinstance(value, float) and math.isfinite(value):
                low = math.floor(value)
                return (f"{text}: {key} takes an integer, not {value}; write {key}={low} or "
                        f"{key}={low + 1}")
            return f"{text}: {key} takes an integer; write a whole number ({key}=N)"
        err = err.__cause__
    return None


def available_memory(cfg: Config) -> tuple[Optional[int], str]:
    """What one rank's device (CUDA) or one node's ranks together (CPU) can use, in bytes;
    None when it cannot be known here."""
    if cfg.train.device != "cpu" and may_have_cuda():
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory, "cuda"
    try:
        with open("/proc/meminfo") as handle:
            fields = dict(line.split(":", 1) for line in handle)
        return int(fields["MemAvailable"].split()[0]) * 1024, "cpu"
    except (OSError, KeyError, ValueError):
        return None, "cpu"


def may_have_cuda() -> bool:
    """False when torch cannot see a CUDA device here because no GPU driver is loaded
    (NVIDIA's control node, its WSL bridge, or ROCm's, which torch also reports as CUDA): the
    launcher then does not import torch to ask (2-3 s), and the fork server's imports of it
    overlap the launcher's own."""
    return any(os.path.exists(node) for node in ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd"))


def exit_user_error(err: Exception | str) -> NoReturn:
    """One line on stderr, no traceback, exit status 2: the contract for every user error."""
    message = " ".join(str(err).split("\n"))
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USER_ERROR_EXIT)
