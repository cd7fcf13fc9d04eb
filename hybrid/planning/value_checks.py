"""Each config field's own value checked on its own (pure: no torch): a known name, an integer
>= 1, a finite number in range, a seed whose per-block streams fit torch's generator.

Apart from ``validate.py`` (the checks of how the fields fit together: model and layout,
schedule, batch, world) because these rules need no layout and read one field at a time.
"""

from __future__ import annotations

import math

from hybrid.planning.config import Config
from hybrid.planning.layout import LayoutError


def choose(field: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise LayoutError(f"{field}={value!r} is unknown; choose one of "
                          f"{', '.join(map(str, allowed))}")


def positive(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{field}={value!r} must be an integer >= 1")


def non_negative(field: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise LayoutError(f"{field}={value} must be a finite number >= 0")


def above_zero(field: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise LayoutError(f"{field}={value} must be a finite number > 0")


MAX_SEED = (2**63 - 1) // 1_000_003 - 1_000_003
"""The largest seed whose per-block streams (``seed * 1_000_003 + block``,
``hybrid.model.gpt.block_seed``) fit torch's 64-bit generator seed."""


def check_numbers(cfg: Config) -> None:
    """Every number finite and in range (a NaN passes ``< 0`` checks, so test finiteness)."""
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or \
            not 0 <= cfg.seed <= MAX_SEED:
        raise LayoutError(f"seed={cfg.seed} must be an integer in 0..{MAX_SEED:,} (each block's "
                          f"weights draw from a 64-bit stream derived from it); choose one in "
                          f"that range")
    optim = cfg.optim
    for field in ("lr", "min_lr", "weight_decay"):
        non_negative(f"optim.{field}", getattr(optim, field))
    above_zero("optim.eps", optim.eps)
    if optim.min_lr > optim.lr:
        raise LayoutError(f"optim.min_lr={optim.min_lr} is above optim.lr={optim.lr}; the "
                          f"cosine decays from lr down to min_lr: lower min_lr")
    non_negative("optim.warmup_steps", optim.warmup_steps)
    for field in ("beta1", "beta2"):
        if not 0 <= getattr(optim, field) < 1:
            raise LayoutError(f"optim.{field}={getattr(optim, field)} must be in [0, 1)")
    above_zero("model.init_std", cfg.model.init_std)
    above_zero("model.norm_eps", cfg.model.norm_eps)
    non_negative("train.grad_clip", cfg.train.grad_clip)
    non_negative("checkpoint.every", cfg.checkpoint.every)
    non_negative("checkpoint.keep", cfg.checkpoint.keep)
    non_negative("train.timeline_step", cfg.train.timeline_step)
    positive("train.log_every", cfg.train.log_every)
    above_zero("parallel.bucket_mb", cfg.parallel.bucket_mb)
    above_zero("train.collective_timeout_s", cfg.train.collective_timeout_s)
    ratio = cfg.train.straggler_ratio
    if ratio != 0 and not ratio > 1:
        raise LayoutError(f"train.straggler_ratio={ratio} must be above 1 (a rank that slow "
                          f"relative to its peers is named), or 0 to turn the warning off")
    if cfg.launcher.omp_threads is not None:
        positive("launcher.omp_threads", cfg.launcher.omp_threads)
    non_negative("launcher.max_restarts", cfg.launcher.max_restarts)
    _check_slurm_numbers(cfg.launcher)
    if cfg.data.source == "synthetic":
        positive("data.samples", cfg.data.samples)


def _check_slurm_numbers(launcher) -> None:
    positive("launcher.time_min", launcher.time_min)
    for name in ("cpus_per_task", "mem_gb"):
        if getattr(launcher, name) is not None:
            positive(f"launcher.{name}", getattr(launcher, name))
    if launcher.gpus_per_node is not None:
        non_negative("launcher.gpus_per_node", launcher.gpus_per_node)

