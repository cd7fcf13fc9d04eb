"""Upper bounds on the values the planner and the data grow with (pure: no torch), checked
first by ``validate.config_problems`` so that nothing is built from a value beyond one: a typo
such as ``train.global_batch=1000000000000`` is refused in one line instead of filling memory
with a schedule's actions. The bounds (``hybrid.planning.config``'s ``MAX_*``) are far beyond
any real run; each refusal suggests a setting within all of them.
"""

from __future__ import annotations

from hybrid.planning import config as bounds
from hybrid.planning.config import Config
from hybrid.planning.data_sources import evaluates, has_validation_split


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def bound_problem(cfg: Config) -> str | None:
    """The first value beyond its bound (``hybrid.planning.config``'s ``MAX_*``: far beyond
    any real run), with a setting within every bound; None when all are within. A value of
    the wrong type or below 1 is left to its own check."""
    m, t = cfg.model, cfg.train
    for field, value, limit in (("model.seq_len", m.seq_len, bounds.MAX_SEQ_LEN),
                                ("model.vocab", m.vocab, bounds.MAX_VOCAB),
                                ("train.steps", t.steps, bounds.MAX_STEPS)):
        if _integer(value) and value > limit:
            return (f"{field}={value:,} is beyond the bound of {limit:,} (no real run comes "
                    f"near it: a typo?); choose {field} <= {limit}")
    return _batch_bound_problem(cfg) or _samples_bound_problem(cfg)


def _batch_bound_problem(cfg: Config) -> str | None:
    t, par = cfg.train, cfg.parallel
    if not all(_integer(v) and v >= 1 for v in (t.global_batch, t.micro_batch, par.dp, par.pp)):
        return None
    per_step = par.dp * t.micro_batch
    if t.global_batch > bounds.MAX_GLOBAL_BATCH:
        what = f"train.global_batch={t.global_batch:,} is beyond the bound of " \
               f"{bounds.MAX_GLOBAL_BATCH:,} sequences per step"
    elif t.micro_batch > bounds.MAX_MICRO_BATCH:
        what = f"train.micro_batch={t.micro_batch:,} is beyond the bound of " \
               f"{bounds.MAX_MICRO_BATCH:,} sequences per micro-batch"
    elif t.global_batch // per_step > bounds.MAX_MICROBATCHES:
        what = f"train.global_batch={t.global_batch:,} / (parallel.dp={par.dp} x " \
               f"train.micro_batch={t.micro_batch}) = {t.global_batch // per_step:,} " \
               f"micro-batches per step is beyond the bound of {bounds.MAX_MICROBATCHES:,}"
    else:
        return None
    fix = _batch_within_bounds(cfg)
    if fix.startswith("train.global_batch="):  # a new global batch, near the bound
        fix += _evaluation_off(cfg)
    return f"{what} (no real run comes near it: a typo?); e.g. {fix}"


def _evaluation_off(cfg: Config) -> str:
    """Evaluation reads ``eval.batches`` global batches from the validation split: a batch
    near the bound would read it more than once, so the advice turns evaluation off with it
    (the split's size is the data's, known only once it is read)."""
    if not (evaluates(cfg.eval, cfg.data) and has_validation_split(cfg.data)):
        return ""
    return " eval.every=0 eval.at_end=false"


def _batch_within_bounds(cfg: Config) -> str:
    """A global batch (and micro-batch) within the bounds, near the one given, that the
    layout divides: whole micro-batches per replica, a multiple of pp."""
    t, par = cfg.train, cfg.parallel
    micro = min(t.micro_batch, bounds.MAX_MICRO_BATCH)
    whole = t.global_batch // (par.dp * par.pp)  # one micro-batch per stage
    if micro != t.micro_batch and t.global_batch % (par.dp * par.pp) == 0 and \
            1 <= whole <= bounds.MAX_MICRO_BATCH and t.global_batch <= bounds.MAX_GLOBAL_BATCH:
        return f"train.micro_batch={whole}"
    per_step = par.dp * micro
    count = min(bounds.MAX_MICROBATCHES, bounds.MAX_GLOBAL_BATCH // per_step,
                max(1, t.global_batch // per_step))
    count = max(par.pp, count - count % par.pp)
    fix = f"train.global_batch={per_step * count}"
    return fix if micro == t.micro_batch else f"{fix} train.micro_batch={micro}"


def _samples_bound_problem(cfg: Config) -> str | None:
    t = cfg.train
    if not (_integer(t.steps) and _integer(t.global_batch) and t.global_batch >= 1):
        return None
    if t.steps * t.global_batch <= bounds.MAX_TRAIN_SAMPLES:
        return None
    return (f"train.steps={t.steps:,} x train.global_batch={t.global_batch:,} = "
            f"{t.steps * t.global_batch:,} sequences is beyond the bound of "
            f"{bounds.MAX_TRAIN_SAMPLES:,} (no real run comes near it: a typo?); choose "
            f"train.steps <= {bounds.MAX_TRAIN_SAMPLES // t.global_batch}")
