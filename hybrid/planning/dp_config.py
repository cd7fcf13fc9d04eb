"""The DP strategies' settings (``parallel.dp_strategy.*``): one dataclass per strategy, each
chosen on the command line as a Hydra config group, ``conf/parallel/dp/*.yaml``
(``parallel/dp=zero3``, or several at once, ``parallel/dp=[zero1,bf16]``).

Each strategy's runtime is ``hybrid.dp`` and its facts ``hybrid.planning.strategies``, which
read these through ``DpOptions.of``. The flat keys of before (``parallel.zero``,
``parallel.dp_compress``, ...) stay: ``FLAT_KEYS`` names, once, where each now lives, and
``ParallelConfig`` takes them as arguments and attributes (``flat_keys``); hybrid's commands
rewrite them on the command line (``launch.commands.app.new_overrides``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybrid.planning import moved_keys


@dataclass(kw_only=True)
class ZeroConfig:
    stage: int = 0
    """ZeRO stage: 0 = replicated optimizer state, 1 = optimizer state sharded over DP,
    2 = gradients sharded too (reduce-scattered every micro-batch, only the shard kept),
    3 = weights sharded too (each stage's gathered for its computes, released after)."""
    reshard: str = "after_forward"
    """stage=3: when a stage's gathered weights are released: after_forward (after every
    forward and backward: 2m gathers a step, least memory) | after_step (after the stage's
    last use in the step: one gather a step, the stage held whole through it)."""


@dataclass(kw_only=True)
class PowerSgdConfig:
    rank: int = 2
    """PowerSGD's approximation rank r (torch's matrix_approximation_rank)."""
    warmup: int = 10
    """Steps reduced exactly before PowerSGD starts (torch's start_powerSGD_iter)."""


@dataclass(kw_only=True)
class LocalSgdConfig:
    every: int = 1
    """Local SGD: replicas step on their own gradients and average parameters every this
    many steps; 1 = exact data parallelism."""
    moments: bool = False
    """With every > 1: average AdamW's moments at each sync too."""


@dataclass(kw_only=True)
class BalanceConfig:
    mode: str = "even"
    """How the step's micro-batches are shared among the DP replicas: even (the same count
    each) | dynamic (by each replica's measured compute rate, re-decided every ``every``
    steps; the global batch and the losses stay the same: docs/data-parallel.md)."""
    every: int = 5
    """mode=dynamic: steps measured between two decisions of the shares."""
    min_saving: float = 0.1
    """mode=dynamic: new shares are taken only when predicted to save at least this share of
    the step (hysteresis: scheduling noise moves nothing)."""


@dataclass(kw_only=True)
class DpStrategyConfig:
    bucket_mb: float = 25.0
    """Size of a gradient all-reduce bucket in MiB (torch DDP's default is 25)."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """How the DP state is sharded (``parallel/dp=zero1|zero2|zero3``)."""
    compress: str = "none"
    """DP gradient compression: none (exact fp32) | bf16 (reduce bf16 copies) | powersgd
    (rank-r factors with error feedback, Vogels et al. 2019). Lossy: docs/data-parallel.md."""
    powersgd: PowerSgdConfig = field(default_factory=PowerSgdConfig)
    """compress=powersgd's settings (``parallel/dp=powersgd``)."""
    local_sgd: LocalSgdConfig = field(default_factory=LocalSgdConfig)
    """Local SGD's (``parallel/dp=local-sgd``)."""
    delay: int = 0
    """1 = apply each step's DP gradient mean one step late, its all-reduce overlapping the
    next step's compute (the first step takes no optimizer step); 0 = exact
    (``parallel/dp=delayed``)."""
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    """How micro-batches are shared among replicas (``parallel/dp=dynamic``)."""


FLAT_KEYS = {
    "zero": "zero.stage", "zero3_reshard": "zero.reshard", "bucket_mb": "bucket_mb",
    "dp_compress": "compress", "powersgd_rank": "powersgd.rank",
    "powersgd_warmup": "powersgd.warmup", "dp_sync_every": "local_sgd.every",
    "dp_sync_moments": "local_sgd.moments", "dp_delay": "delay", "dp_balance": "balance.mode",
    "dp_balance_every": "balance.every", "dp_balance_min_saving": "balance.min_saving",
}
"""``parallel.<flat key>`` -> where it lives under ``parallel.dp_strategy``."""

SECTION = "dp_strategy"


def new_key(flat: str) -> str:
    """``zero`` -> ``dp_strategy.zero.stage`` (relative to ``parallel``)."""
    return f"{SECTION}.{FLAT_KEYS[flat]}"


flat_keys = moved_keys.flat_keys(SECTION, FLAT_KEYS)
"""Give a dataclass with a ``dp_strategy`` field the flat keys (``hybrid.planning.moved_keys``:
attributes read and written through, arguments of ``__init__``)."""
