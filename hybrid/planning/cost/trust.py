"""What a prediction may be trusted to (pure: no torch): the device it assumed, what is known
of the model's error there, and a warning when the model lies outside what that error was
measured on. ``hybrid-plan``, its search and the sweep report print this beside their
predictions (#30: a prediction without a word of its error misleads)."""

from __future__ import annotations

from hybrid.planning.config import Config
from hybrid.planning.cost.device_files import source_said
from hybrid.planning.cost.devices import Device
from hybrid.planning.cost.sizes import param_count

CHECKED_FROM_PARAMS = 1e9
"""The smallest published run a GPU preset was checked on is 1.7B parameters; below 1B, a
model's narrow layers and tiny kernels run further from the fitted rates than any run checked."""


def assumption_line(device: Device, cfg: Config | None = None) -> str:
    """``predictions assume cost.device=NAME[ (device file PATH, measured AGE ago)]: <its known
    error>[; <outside the checked range>]``."""
    known = device.error or "the model's error on it is not measured"
    source = source_said(device.file, device.file_time)
    line = (f"predictions assume cost.device={device.name}"
            f"{f' ({source})' if source else ''}: {known}")
    if cfg is not None and not device.host and param_count(cfg.model) < CHECKED_FROM_PARAMS:
        line += (f"; this {param_count(cfg.model) / 1e6:.0f}M-parameter model is far smaller "
                 f"than the runs it was checked on (1.7B and up): expect it to run slower "
                 f"than predicted")
    return line
