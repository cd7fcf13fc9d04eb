"""What a config's ``data`` names, read without touching a file (pure: no torch, no numpy).

``data_problem(data)`` is the one-line problem of the data settings themselves (an unknown
source, a blend list of odd length, a weight that is not a positive finite number, a split
that is not three parts with a positive train part), checked with the rest of the config
before launch; ``blend_of(data)`` the data sets an indexed source reads and their weights.
The files themselves are checked by ``hybrid.data`` (numpy), also before launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

SOURCES = ("synthetic", "tokens", "indexed")
EXAMPLES = ("python-docs",)
"""Built-in corpora for data.example (``hybrid.data.examples``)."""
SPLITS = ("train", "valid", "test")
SPLIT_NAMES = {"train": "train", "valid": "validation", "test": "test"}


@dataclass(frozen=True)
class Blend:
    """Data sets by weight: ``weights`` None for one data set (Megatron's ``blend=(paths,
    None)``); otherwise normalised to sum 1."""

    prefixes: tuple[str, ...]
    weights: Optional[tuple[float, ...]]


def data_problem(data: Any) -> Optional[str]:
    """The first problem of ``data``'s settings, one line with the fix; None when none."""
    if data.source not in SOURCES:
        return f"data.source={data.source!r} is unknown; choose one of {', '.join(SOURCES)}"
    if data.source != "indexed":
        for field in ("blend", "example"):
            if getattr(data, field) is not None:
                return (f"data.{field}={getattr(data, field)} is for data.source=indexed, "
                        f"not data.source={data.source}: choose the data group whole with "
                        f"data={data.source} (no data.{field}), or set data.{field}=null")
        return None
    if data.example is not None:
        if data.example not in EXAMPLES:
            return (f"data.example={data.example!r} is unknown; choose one of "
                    f"{', '.join(EXAMPLES)}, or give files with data.path")
        if data.path is not None or data.blend is not None:
            return ("data.example and data.path/data.blend both name data; give one (drop "
                    "data.example with data.example=null)")
        return split_problem(data.split)
    return _blend_problem(data) or split_problem(data.split)


AUTO_EVAL_EVERY = 20
"""``eval.every`` when it is left unset (null) and the data has a validation split: what the
main job evaluates at; Megatron-LM likewise evaluates whenever it has validation data."""
EVAL_SAMPLES_LIMIT = 2**20
"""The most samples one evaluation may read (``eval.batches x train.global_batch``): beyond any
validation split a run evaluates on (Megatron-LM's default is 100 batches), and refused at once
where the files are not read yet (megatron would spend minutes building the indices)."""


def has_validation_split(data: Any) -> bool:
    """Whether the data comes with a validation split: data=indexed whose ``data.split`` has a
    validation part (data=synthetic's held-out walks are there only when asked for)."""
    return (data.source == "indexed" and not split_problem(data.split)
            and split_fractions(data.split)[1] > 0)


def eval_cadence(eval_cfg: Any, data: Any) -> tuple[int, bool]:
    """(``eval.every``, ``eval.at_end``) as the run evaluates: a value set is kept; one left
    unset (null, the default) is on when the data has a validation split (every
    ``AUTO_EVAL_EVERY`` steps, and at the end when it evaluates every N steps)."""
    every = eval_cfg.every
    if every is None:
        every = AUTO_EVAL_EVERY if has_validation_split(data) else 0
    at_end = eval_cfg.at_end
    if at_end is None:
        at_end = bool(every) and has_validation_split(data)
    return every, at_end


def evaluates(eval_cfg: Any, data: Any) -> bool:
    """Whether the run evaluates at all."""
    every, at_end = eval_cadence(eval_cfg, data)
    return every > 0 or at_end


def read_parts(eval_cfg: Any, data: Any) -> tuple[bool, bool, bool]:
    """Which parts of ``data.split`` a run reads: train always, validation when it evaluates
    (``eval_cfg`` None: assume it does), test never (hybrid has no test pass: the part only
    keeps its documents out of the other two). A part nothing reads is not built, so an empty
    one refuses nothing."""
    return True, eval_cfg is None or evaluates(eval_cfg, data), False


def working_split(documents: list[int], read: tuple[bool, bool, bool]
                  ) -> Optional[tuple[int, int, int]]:
    """A ``data.split`` that gives every part in ``read`` a document of each data set of
    ``documents`` (their counts), or None when they are too few."""
    candidate = (min(documents) - 1, 1, 0) if read[1] else (1, 0, 0)
    if candidate[0] < 1:
        return None
    for count in documents:
        parts = split_documents(candidate, count)
        if any(wanted and part == 0 for wanted, part in zip(read, parts)):
            return None
    return candidate


def eval_problem(eval_cfg: Any, data: Any) -> Optional[str]:
    """The problem of the ``eval`` settings with this data (one line), or None. Only settings
    given ask for validation data: left unset they evaluate where there is some."""
    every, batches = eval_cfg.every, eval_cfg.batches
    if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                              or every < 0):
        return f"eval.every={every!r} must be an integer >= 0 (0: never)"
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        return f"eval.batches={batches!r} must be an integer >= 1"
    if not evaluates(eval_cfg, data):
        return None
    asked, off = [], []  # what asked for an evaluation, and the overrides that do not
    if every:
        asked, off = [f"eval.every={every}"], ["eval.every=0"]
    if eval_cfg.at_end:
        asked, off = asked + ["eval.at_end=true"], off + ["eval.at_end=false"]
    asked, off = " and ".join(asked), " ".join(off)
    if data.source == "tokens":
        return (f"{asked} needs validation data, and data=tokens has none; use "
                f"data=indexed (its data.split's validation part) or {off}")
    if data.source == "indexed" and not split_problem(data.split) and \
            not has_validation_split(data):
        return (f"{asked} needs validation data, and data.split="
                f"{show_list(data.split)} has no validation part; give it one, e.g. "
                f"data.split=[969,30,1], or {off}")
    return None


def eval_size_problem(eval_cfg: Any, data: Any, global_batch: Any) -> Optional[str]:
    """``eval.batches`` beyond what an evaluation may read: ``EVAL_SAMPLES_LIMIT`` samples,
    and for data=synthetic its held-out walks (as many as it trains on: ``data.samples``); an
    indexed validation split is measured from its files (``hybrid.data.eval_split``)."""
    if not evaluates(eval_cfg, data) or isinstance(global_batch, bool) or \
            not isinstance(global_batch, int) or global_batch < 1:
        return None  # the batch's own rule says so
    samples, batches = eval_cfg.batches * global_batch, eval_cfg.batches
    if data.source == "synthetic" and isinstance(data.samples, int) and \
            samples > data.samples >= global_batch:
        return (f"eval.batches={batches} x train.global_batch={global_batch} = {samples:,} "
                f"samples per evaluation, and data=synthetic holds out data.samples="
                f"{data.samples:,} walks (as many as it trains on); choose eval.batches <= "
                f"{data.samples // global_batch}")
    if samples > EVAL_SAMPLES_LIMIT:
        fix = f"choose eval.batches <= {EVAL_SAMPLES_LIMIT // global_batch}" \
            if global_batch <= EVAL_SAMPLES_LIMIT else \
            f"one batch is beyond it: turn evaluation off with eval.every=0 " \
            f"eval.at_end=false, or lower train.global_batch to <= {EVAL_SAMPLES_LIMIT:,} " \
            f"with eval.batches=1"
        return (f"eval.batches={batches} x train.global_batch={global_batch:,} = {samples:,} "
                f"samples per evaluation is beyond the limit of {EVAL_SAMPLES_LIMIT:,}; {fix}")
    return None


def _blend_problem(data: Any) -> Optional[str]:
    if data.blend is not None and data.path is not None:
        return ("data.path and data.blend both name data; give one: data.path=PREFIX or "
                "data.blend=[0.7,PREFIX_A,0.3,PREFIX_B]")
    if data.blend is None:
        if not data.path:
            return ("data.source=indexed needs data.path=PREFIX (PREFIX.bin and PREFIX.idx) "
                    "or data.blend=[0.7,PREFIX_A,0.3,PREFIX_B]")
        return None
    items = list(data.blend)
    if not items or len(items) % 2:
        return (f"data.blend={show_list(items)} has {len(items)} items; it alternates weight "
                f"and prefix: data.blend=[0.7,PREFIX_A,0.3,PREFIX_B]")
    for weight, prefix in zip(items[0::2], items[1::2]):
        if _weight(weight) is None:
            return (f"data.blend weight {weight!r} (of {prefix}) must be a positive finite "
                    f"number; the list alternates weight and prefix")
        if not isinstance(prefix, str) or not prefix:
            return (f"data.blend prefix {prefix!r} must be a path prefix (PREFIX for "
                    f"PREFIX.bin and PREFIX.idx); the list alternates weight and prefix")
    return None


def split_problem(split: Any) -> Optional[str]:
    """The problem of a ``data.split`` (three non-negative numbers, train part positive)."""
    parts = [_number(part) for part in split] if isinstance(split, (list, tuple)) else []
    if len(parts) != 3 or any(p is None or p < 0 for p in parts) or parts[0] == 0:
        return (f"data.split={show_list(split)} must be three non-negative numbers (train, "
                f"validation, test parts by document) with a positive train part, e.g. "
                f"data.split=[969,30,1]")
    return None


def blend_of(data: Any) -> Blend:
    """The data sets of a checked indexed source (``data_problem`` found nothing); a built-in
    example's prefix is known once it is written (the plan's ``data_prefixes``)."""
    if data.example is not None:
        return Blend(prefixes=(), weights=None)
    if data.blend is None:
        return Blend(prefixes=(data.path,), weights=None)
    items = list(data.blend)
    weights = [_weight(w) for w in items[0::2]]
    total = sum(weights)
    return Blend(prefixes=tuple(items[1::2]), weights=tuple(w / total for w in weights))


def split_fractions(split: Any) -> tuple[float, float, float]:
    """``data.split`` normalised (Megatron's ``split_matrix`` widths)."""
    parts = [float(p) for p in split]
    return tuple(p / sum(parts) for p in parts)  # type: ignore[return-value]


def split_documents(split: Any, documents: int) -> tuple[int, int, int]:
    """How many of ``documents`` each split gets, as megatron-core's builder cuts them: the
    split's bookends (cumulative fractions) each rounded to a document index."""
    fractions = split_fractions(split)
    ends = [sum(fractions[:i + 1]) for i in range(3)]
    starts = [0.0] + ends[:2]
    return tuple(int(round(end * documents)) - int(round(start * documents))  # type: ignore
                 if fraction > 0 else 0
                 for start, end, fraction in zip(starts, ends, fractions))


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _weight(value: Any) -> Optional[float]:
    number = _number(value)
    return number if number is not None and number > 0 else None


def show_list(items: Any) -> str:
    """A list as the override that gives it (``[969,30,1]``, not ``[969.0,30.0,1.0]``)."""
    if isinstance(items, (list, tuple)):
        return "[" + ",".join(f"{item:g}" if isinstance(item, float) else str(item)
                              for item in items) + "]"
    return repr(items)
