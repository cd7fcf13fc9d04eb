"""Check a whole config before any worker starts (pure: no torch).

``validate_config(cfg)`` raises ``LayoutError`` with one line naming the field, the values and
the fix, or returns the ``Layout`` the job will use; ``plan_job`` calls it, once, before any
process starts, so a bad config never starts one. The rules of a schedule, a DP strategy or a
launcher are their own (their registries: ``schedules``, ``strategies``, ``launch.launchers.launcher``);
the choices of ``parallel.schedule``, ``parallel.dp_compress`` and ``parallel.zero`` are the
registered ones. Each field's own range is checked in ``value_checks``, the launcher's world
in ``world_checks``.
"""

from __future__ import annotations

import math

from hybrid.planning.config import ADAMW_IMPLEMENTATIONS, Config, ModelConfig
from hybrid.planning.bounds import bound_problem
from hybrid.planning.balance import balance_warnings, check_balance, replica_speed_problem
from hybrid.planning.stage_balance import check_stage_balance, stage_balance_warnings
from hybrid.planning.context import context_problem
from hybrid.planning.expert_grid import expert_problem
from hybrid.planning.data_sources import data_problem, eval_problem, eval_size_problem
from hybrid.planning.strategies import DpOptions, option_problem, reduction_of
from hybrid.planning.layout import Layout, LayoutError
from hybrid.planning.models import model_spec
from hybrid.planning.schedules import SCHEDULES, batch_problem, layout_problem, schedule_names
from hybrid.planning.schedules.actions import LOOP
from hybrid.planning.schedules.gathers import RESHARD_POLICIES
from hybrid.planning.value_checks import check_numbers, choose, positive
from hybrid.planning.world_checks import check_world

PRECISIONS = ("fp32", "bf16")
RECOMPUTE = ("none", "selective", "full")
DEVICES = ("auto", "cpu", "cuda")
PARTITIONS = ("uniform", "balanced", "measured")


def valid_tp_sizes(m: ModelConfig) -> list[int]:
    """TP sizes that split the model evenly (its family's rule: heads, MLP, vocabulary)."""
    return model_spec(m).valid_tp_sizes(m)


def check_model_shape(m: ModelConfig, tp: int = 1) -> None:
    """The model's own shape rules, and that ``tp`` splits what tensor parallelism splits:
    its family's (``hybrid.planning.models``), after the family itself is known."""
    model_spec(m).check_shape(m, tp)


def validate_config(cfg: Config) -> Layout:
    """Every check that can be made before launch; returns the job's ``Layout``, or raises
    ``LayoutError`` with the first problem's line (and how many more there are)."""
    problems = config_problems(cfg)
    if problems:
        more = len(problems) - 1
        raise LayoutError(problems[0] + (f" ({more} more problem{'s' * (more > 1)}: "
                                         f"hybrid-plan lists them all)" if more else ""))
    return layout_of(cfg)


def layout_of(cfg: Config) -> Layout:
    """The rank grid ``cfg.parallel`` declares (raises ``LayoutError`` on a bad size)."""
    par = cfg.parallel
    return Layout(dp=par.dp, cp=par.cp, tp=par.tp, pp=par.pp, order=par.order, vpp=par.vpp,
                  stage_placement=_placement(par.schedule), ep=par.ep)


def config_problems(cfg: Config) -> list[str]:
    """Every problem of ``cfg``, one line each (each check reports its first); the checks of
    the layout's consequences run only once the sizes make a layout. A value beyond its bound
    is the only problem reported: the other checks may build what grows with it."""
    beyond = bound_problem(cfg)
    if beyond:
        return [beyond]
    problems = [p for p in (_problem(check, cfg) for check in (
        _check_names, check_numbers, _check_dp_options, _check_data)) if p]
    try:
        layout = layout_of(cfg)
    except LayoutError as err:
        return problems + [str(err)]
    for check in (_check_model, _check_partition, check_stage_balance, _check_schedule,
                  _check_batch, check_world):
        problem = _problem(check, cfg, layout)
        if problem:
            problems.append(problem)
    return problems


def _problem(check, *args) -> str | None:
    try:
        check(*args)
    except LayoutError as err:
        return str(err)
    return None


def _check_names(cfg: Config) -> None:
    choose("parallel.schedule", cfg.parallel.schedule, schedule_names())
    choose("parallel.zero3_reshard", cfg.parallel.zero3_reshard, RESHARD_POLICIES)
    choose("parallel.partition", cfg.parallel.partition, PARTITIONS)
    choose("train.precision", cfg.train.precision, PRECISIONS)
    choose("model.recompute", cfg.model.recompute, RECOMPUTE)
    choose("train.device", cfg.train.device, DEVICES)
    choose("launcher.start_method", cfg.launcher.start_method, ("forkserver", "spawn"))
    choose("optim.name", cfg.optim.name, ("adamw",))
    choose("optim.implementation", cfg.optim.implementation, ADAMW_IMPLEMENTATIONS)


def _check_dp_options(cfg: Config) -> None:
    """The DP strategies' own rules (``hybrid.planning.strategies``)."""
    options = DpOptions.of(cfg.parallel)
    problem = option_problem(options, cfg.parallel.dp) or reduction_of(options).run_problem(
        options, steps=cfg.train.steps, checkpoint_every=cfg.checkpoint.every)
    if problem:
        raise LayoutError(problem)
    check_balance(cfg.parallel)
    problem = replica_speed_problem(cfg.cost.replica_speed, cfg.parallel.dp)
    if problem:
        raise LayoutError(problem)


def _check_data(cfg: Config) -> None:
    """The data settings (``data_sources``); the files are checked by ``hybrid.data``."""
    problem = data_problem(cfg.data) or eval_problem(cfg.eval, cfg.data) or \
        eval_size_problem(cfg.eval, cfg.data, cfg.train.global_batch)
    if problem:
        raise LayoutError(problem)


def config_warnings(cfg: Config) -> list[str]:
    """Settings that run but are probably not meant: one line each, printed before launch."""
    warnings = []
    if cfg.optim.warmup_steps > cfg.train.steps:
        warnings.append(f"optim.warmup_steps={cfg.optim.warmup_steps} is longer than "
                        f"train.steps={cfg.train.steps}: the learning rate never reaches "
                        f"optim.lr={cfg.optim.lr}")
    if cfg.launcher.max_restarts and not cfg.checkpoint.every:
        warnings.append(f"launcher.max_restarts={cfg.launcher.max_restarts} without "
                        f"checkpoint.every: a restarted group starts again from step 1; set "
                        f"checkpoint.every=N to resume from the newest checkpoint")
    if cfg.checkpoint.dir is not None and not cfg.checkpoint.every:
        warnings.append(f"checkpoint.dir={cfg.checkpoint.dir} without checkpoint.every: "
                        f"nothing is saved there; set checkpoint.every=N to save checkpoints")
    return warnings + position_warnings(cfg.model) + balance_warnings(cfg) + \
        stage_balance_warnings(cfg)


ROPE_SCALED_FAMILIES = ("llama3",)
"""Presets (by name prefix) whose published models reach past ``rope_original_positions``
only through Llama 3.1's ``llama3`` rope scaling (``model.rope_scaling``)."""


def position_warnings(m: ModelConfig) -> list[str]:
    """A Llama 3 preset without rope scaling run past the positions it was trained at: the
    run is legitimate (a model trained from scratch at that length), one meant to match the
    published model's long context is not."""
    trained = m.rope_original_positions
    if not (m.name.startswith(ROPE_SCALED_FAMILIES) and m.rope_scaling == "none"
            and isinstance(m.seq_len, int) and m.seq_len > trained):
        return []
    return [f"model.seq_len={m.seq_len} is past the {trained} positions model={m.name} was "
            f"trained at, with model.rope_scaling=none: its rotary frequencies are not "
            f"stretched; set model.rope_scaling=llama3 model.rope_factor=8.0 (Llama 3.1's) "
            f"to reach past them as the published long-context models do, or keep "
            f"model.seq_len <= {trained}"]


def _check_model(cfg: Config, layout: Layout) -> None:
    m = cfg.model
    check_model_shape(m, layout.tp)
    if cfg.parallel.sequence_parallel and m.seq_len % layout.tp:
        raise LayoutError(f"parallel.sequence_parallel=true needs model.seq_len={m.seq_len} "
                          f"divisible by parallel.tp={layout.tp}; change seq_len or tp")
    problem = context_problem(m.seq_len, cfg.parallel) or expert_problem(cfg, layout)
    if problem:
        raise LayoutError(problem)
    stages = layout.pp * layout.vpp
    if stages > m.layers:
        raise LayoutError(
            f"parallel.pp={layout.pp} x parallel.vpp={layout.vpp} = {stages} stages exceeds "
            f"model.layers={m.layers}; every stage needs a layer: lower pp/vpp or add layers")


def _check_partition(cfg: Config, layout: Layout) -> None:
    """Measured costs go with partition=measured only, one finite cost >= 0 per block."""
    par, n_blocks = cfg.parallel, cfg.model.layers + 2
    if par.partition != "measured":
        for name in ("partition_file", "block_costs"):
            if getattr(par, name) is not None:
                raise LayoutError(f"parallel.{name} is set but parallel.partition="
                                  f"{par.partition} ignores it; set parallel.partition=measured "
                                  f"or drop parallel.{name}")
        return
    costs = par.block_costs
    if costs is not None and (len(costs) != n_blocks or not all(
            math.isfinite(c) and c >= 0 for c in costs)):
        raise LayoutError(f"parallel.block_costs has {len(costs)} values, needs {n_blocks} "
                          f"finite seconds >= 0 (embedding, model.layers={cfg.model.layers} "
                          f"layers, head); drop it to measure them")


def _placement(schedule: str) -> str:
    """Where the schedule puts its stages (an unknown name is reported by ``_check_names``)."""
    spec = SCHEDULES.get(schedule)
    return spec.placement if spec is not None else LOOP


def _check_schedule(cfg: Config, layout: Layout) -> None:
    """What the schedule's spec requires of the layout (``hybrid.planning.schedules``)."""
    if cfg.parallel.schedule not in SCHEDULES:
        return  # _check_names said so
    problem = layout_problem(cfg.parallel.schedule, pp=layout.pp, vpp=layout.vpp,
                             device=cfg.train.device)
    if problem:
        raise LayoutError(problem)


def microbatches(cfg: Config) -> int:
    """Micro-batches per optimizer step on each DP replica."""
    return cfg.train.global_batch // (cfg.parallel.dp * cfg.train.micro_batch)


def _check_batch(cfg: Config, layout: Layout) -> None:
    t = cfg.train
    for name in ("steps", "global_batch", "micro_batch"):
        positive(f"train.{name}", getattr(t, name))
    per_step = layout.dp * t.micro_batch
    if t.global_batch % per_step:
        fits = [g for g in range(per_step, 4 * per_step + 1, per_step)]
        raise LayoutError(
            f"train.global_batch={t.global_batch} is not divisible by parallel.dp={layout.dp} x "
            f"train.micro_batch={t.micro_batch} = {per_step}; use global_batch in "
            f"{{{', '.join(map(str, fits))}, ...}} or change micro_batch")
    m = microbatches(cfg)
    if cfg.parallel.schedule not in SCHEDULES:
        return
    problem = batch_problem(cfg.parallel.schedule, pp=layout.pp, m=m,
                            how=f"global_batch {t.global_batch} / (dp {layout.dp} x "
                                f"micro_batch {t.micro_batch})")
    if problem:
        raise LayoutError(problem)


def ranks_per_node(cfg: Config, layout: Layout) -> int:
    """Processes per node the launcher will start (for placement reports)."""
    if cfg.launcher.nproc_per_node is not None:
        return cfg.launcher.nproc_per_node
    return layout.world_size // cfg.launcher.nnodes
