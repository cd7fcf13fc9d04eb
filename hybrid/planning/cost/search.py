"""Rank every layout of N devices before launch (pure: no torch): ``hybrid-plan search.world=N``.

For the config's model and global batch, every (dp, cp, tp, pp, vpp, schedule, micro-batch,
zero, sequence parallelism, recompute) that ``validate_config`` accepts is planned
(``plan_job`` with closed-form schedule shapes), dropped when its largest rank does not fit in
the device's memory, and priced (``hybrid.planning.cost.steptime``); the best are priced again with the
schedule simulated where that is cheap, and returned best first. Rejections are counted by
reason. Tensor parallelism stays inside a node (``cost.gpus_per_node``), as every production
recipe keeps it; the schedules and chunk counts tried are each spec's ``search_vpps`` (gpipe,
1F1B's time with more memory, and zb-v, gloo only, are left out; dualpipev, gloo only too, is
tried, and refused by validation for ``train.device=cuda``). Context parallelism is tried
in powers of two while each rank keeps at least ``MIN_CP_TOKENS`` tokens of a sequence: below
that attention is too small a share of the work to hide the ring behind.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterator

from hybrid.planning.config import Config
from hybrid.planning.cost import search_prune
from hybrid.planning.cost.devices import Device
from hybrid.planning.cost.search_limits import NONE, SearchLimits, describe
from hybrid.planning.cost.search_prune import (  # noqa: F401 (LOWER_STAGE_FITS: tests)
    LOWER_STAGE_FITS, OUT_OF_MEMORY, zero_stage_skip,
)
from hybrid.planning.cost.search_report import (  # noqa: F401 (hybrid-plan, tests)
    format_search, no_layout_line, overrides_of,
)
from hybrid.planning.cost.sizes import human_bytes
from hybrid.planning.job import plan_job
from hybrid.planning.schedules import SCHEDULES
from hybrid.planning.strategies import SHARDINGS
from hybrid.planning.layout import LayoutError, valid_sizes
from hybrid.planning.cost.steptime import (
    StepPrediction, closed_form_and_bound, predict_step, simulates,
)
from hybrid.planning.validate import RECOMPUTE, valid_tp_sizes, validate_config

MICRO_BATCHES = (1, 2, 4, 8)
MIN_CP_TOKENS = 2048
"""The fewest tokens per rank the search splits a sequence down to with context parallelism
(Megatron-LM's guidance: context parallelism pays from sequences of about 4-8K tokens)."""


@dataclass(frozen=True)
class Candidate:
    settings: dict
    predicted: StepPrediction
    simulated: bool

    def to_dict(self) -> dict:
        p = self.predicted
        return {"settings": self.settings, "schedule_simulated": self.simulated,
                "predicted": {"step_time_s": p.step_time_s,
                              "tflops_per_device": p.tflops_per_device,
                              "mem_bytes_per_rank": p.mem_bytes_per_rank,
                              "bubble_s": p.bubble_s, "dp_exposed_s": p.dp_exposed_s,
                              "dp_contention_s": p.dp_contention_s}}


def settings_of(cfg: Config) -> dict:
    par = cfg.parallel
    experts = {"ep": par.ep} if cfg.model.moe.experts else {}  # tried for MoE models only
    return {"dp": par.dp, "cp": par.cp, "tp": par.tp, "pp": par.pp, "vpp": par.vpp,
            **experts, "schedule": par.schedule,
            "micro_batch": cfg.train.micro_batch, "zero": par.zero,
            "sequence_parallel": par.sequence_parallel, "recompute": cfg.model.recompute}


def candidates(cfg: Config, world: int, limits: SearchLimits = NONE) -> Iterator[Config]:
    """Every combination of the searched settings for ``world`` devices that ``limits``
    allows (what ``search.keep`` holds, ``search.schedules`` and the software run)."""
    m, launcher = cfg.model, replace(cfg.launcher, nnodes=1, nproc_per_node=None, node_rank=0)
    tps = limits.only("tp", [tp for tp in valid_tp_sizes(m)
                             if world % tp == 0 and tp <= cfg.cost.gpus_per_node])
    # one model and train section per setting, shared by candidates (none mutates its config)
    models = {mode: replace(m, recompute=mode) for mode in RECOMPUTE}
    dp = cfg.parallel.dp_strategy
    stages = {stage: replace(dp, zero=replace(dp.zero, stage=stage)) for stage in SHARDINGS}
    trains = {mb: replace(cfg.train, micro_batch=mb) for mb in MICRO_BATCHES}
    for tp in tps:
        for cp in limits.only("cp", searched_cps(m.seq_len, world // tp)):
            for pp in limits.only("pp", [p for p in valid_sizes(world // (tp * cp))
                                         if p <= m.layers]):
                dp = world // (tp * cp * pp)
                if not limits.allows("dp", dp):
                    continue
                for (schedule, vpp), mb, zero, sp, recompute in _knobs(pp, dp * cp, tp, limits):
                    for ep in limits.only("ep", searched_eps(m.moe.experts, dp * cp, zero)):
                        yield _copied(
                            cfg, launcher=launcher,
                            parallel=_copied(cfg.parallel, dp=dp, cp=cp, tp=tp, pp=pp,
                                             vpp=vpp, schedule=schedule,
                                             dp_strategy=stages[zero],
                                             sequence_parallel=sp, ep=ep),
                            train=trains[mb], model=models[recompute])


def searched_eps(experts: int, width: int, zero: int) -> list[int]:
    """The expert-parallel sizes tried: 1, and for a model with experts every size dividing
    both its experts and ``dp * cp`` (every ZeRO stage runs on the expert placement)."""
    if not experts:
        return [1]
    return [ep for ep in valid_sizes(width) if experts % ep == 0]


def _copied(section, **changes):
    """``dataclasses.replace`` for the config's plain dataclasses (no ``__post_init__``, no
    init-only fields), a few times faster: a search builds tens of thousands of candidates."""
    new = object.__new__(type(section))
    vars(new).update(vars(section), **changes)
    return new


def searched_cps(seq_len: int, ranks: int) -> list[int]:
    """Context-parallel sizes the search tries: 1, and powers of two that split the sequence
    into ``2 * cp`` chunks and leave each rank ``MIN_CP_TOKENS`` tokens or more."""
    cps, cp = [1], 2
    while ranks % cp == 0 and seq_len % (2 * cp) == 0 and seq_len // cp >= MIN_CP_TOKENS:
        cps.append(cp)
        cp *= 2
    return cps


def searched_schedules(pp: int, limits: SearchLimits = NONE) -> list[tuple[str, int]]:
    """(schedule, vpp) pairs the search tries: every registered schedule's ``search_vpps``
    that ``limits`` allows; with one stage every schedule runs alike, so only the first."""
    found = [(name, vpp) for name, spec in SCHEDULES.items() for vpp in spec.search_vpps
             if limits.allows("schedule", name)]
    return found if pp > 1 else found[:1]


def searched_shardings() -> list[int]:
    """The ZeRO stages the search tries with dp > 1: those whose spec says ``searched``."""
    return [stage for stage, spec in SHARDINGS.items() if spec.searched]


def _knobs(pp: int, dp: int, tp: int, limits: SearchLimits) -> Iterator[tuple]:
    schedules = [(name, vpp) for name, vpp in searched_schedules(pp, limits)
                 if limits.allows("vpp", vpp)]
    zeros = [z for z in (searched_shardings() if dp > 1 else (0,))
             if limits.allows_zero(z, pp)]
    sps = limits.only("sequence_parallel", (False, True) if tp > 1 else (False,))
    recomputes = limits.only("recompute", RECOMPUTE)
    for schedule in schedules:
        for mb in limits.only("micro_batch", MICRO_BATCHES):
            for zero in zeros:
                for sp in sps:
                    for recompute in recomputes:
                        yield schedule, mb, zero, sp, recompute


def search(cfg: Config, world: int, device: Device, top: int = 10,
           limits: SearchLimits = NONE) -> dict:
    """``{"candidates": [...], "rejected": {reason: count}, "considered": n}``, best first,
    of the layouts ``limits`` allows, each priced on ``device`` as ``limits.software``
    drives it.

    Exact whatever ``top`` is: every layout that fits is priced in closed form and, where
    ``predict_step`` would simulate its schedule, bounded from below (``step_lower_bound``;
    elsewhere the closed form is final); layouts are then finished (their schedule simulated)
    in the order of their bound until the next bound is above the ``top``-th best finished
    time, so no layout left unsimulated could have entered the list."""
    rejected: Counter = Counter()
    examples: dict[str, str] = {}
    priced = []
    lower: dict = {}  # layout (ZeRO stage aside) -> the plan of its last stage tried
    verdicts: dict = {}  # settings but recompute -> validate_config's error, or None
    floors: dict = {}  # what memory floors share
    device_of = _software_devices(device, limits)
    for order, candidate in enumerate(candidates(cfg, world, limits)):
        layout_key, spec = _without_zero(candidate), SHARDINGS[candidate.parallel.zero]
        below = lower.get(layout_key)
        if not limits.allows_zero(candidate.parallel.zero - 1, candidate.parallel.pp):
            below = None  # the stage below is not tried (search.keep, the software): no skip
        skip = spec.searched_if_less_fails and zero_stage_skip(spec, below, device)
        if skip:
            _reject(rejected, examples, skip, candidate, device)
            continue
        try:
            _validate_once(candidate, verdicts)
            floor = search_prune.memory_floor(candidate, floors)
            if floor > device.memory_bytes:
                _reject(rejected, examples, OUT_OF_MEMORY, candidate, device, floor)
                continue
            plan = plan_job(candidate, simulated=False)
        except LayoutError as err:
            rejected[_reason(str(err))] += 1
            examples.setdefault(_reason(str(err)), str(err))
            continue
        lower[layout_key] = plan
        need = max(est.total_bytes for est in plan.memory)
        if need > device.memory_bytes:
            _reject(rejected, examples, OUT_OF_MEMORY, candidate, device, need)
            continue
        if simulates(plan):  # finished in the order of its bound, if it can enter the list
            closed, bound = closed_form_and_bound(plan, device_of(candidate))
            priced.append((bound, order, closed, candidate, None))
        else:  # the closed form is final: no bound needed
            closed = predict_step(plan, device_of(candidate), simulated=False)
            priced.append((closed.step_time_s, order, closed, candidate, closed))
    best = _finish(priced, device_of, max(1, top))
    considered = len(priced) + sum(rejected.values())
    return {"world": world, "device": device.name, "software": limits.software.name,
            "limits": describe(limits), "considered": considered,
            "device_memory": device.memory_bytes, "global_batch": cfg.train.global_batch,
            "simulated": sum(1 for c in best if c.simulated),
            "within_error_of_best": _within_error(best[:top], device.error_fraction),
            "error_fraction": device.error_fraction,
            "candidates": [c.to_dict() for c in best[:top]], "rejected": dict(rejected),
            "examples": examples,
            "why_cp": _why_cp(best, priced, device_of)}


def _software_devices(device: Device, limits: SearchLimits):
    """``candidate -> device`` as the software drives it (it may depend on the stages)."""
    by_pp: dict = {}

    def device_of(candidate: Config) -> Device:
        pp = candidate.parallel.pp
        if pp not in by_pp:
            by_pp[pp] = limits.software.device(device, pp)
        return by_pp[pp]
    return device_of


def _reject(rejected: Counter, examples: dict, why: str, candidate: Config, device: Device,
            need: int = 0) -> None:
    """Count a rejection; the first of each reason is the example ``no_layout_line`` names."""
    rejected[why] += 1
    if why not in examples:
        examples[why] = f"{' '.join(overrides_of(settings_of(candidate)))}: {why}" + (
            f", needs {human_bytes(need)} or more of {human_bytes(device.memory_bytes)} "
            f"({device.name})" if need else "")


def _validate_once(candidate: Config, verdicts: dict) -> None:
    """``validate_config``, once for the settings that differ only in ``model.recompute``
    (which it checks only by name: the searched modes are all valid ones)."""
    key = _without_zero(candidate)[:-1] + (candidate.parallel.zero,)
    if key not in verdicts:
        try:
            validate_config(candidate)
            verdicts[key] = None
        except LayoutError as err:
            verdicts[key] = str(err)
    if verdicts[key] is not None:
        raise LayoutError(verdicts[key])


def _without_zero(candidate: Config) -> tuple:
    """A candidate's settings but its ZeRO stage (the stages are tried in order)."""
    par = candidate.parallel
    return (par.dp, par.cp, par.tp, par.pp, par.vpp, par.schedule, par.sequence_parallel,
            candidate.train.micro_batch, candidate.model.recompute)


def _within_error(best: list[Candidate], error: float) -> int | None:
    """How many of the best layouts are predicted within the device's measured error of the
    first (None when the error is not measured): the model cannot rank those."""
    if not best or not error:
        return None
    first = best[0].predicted.step_time_s
    return sum(1 for c in best if c.predicted.step_time_s <= first * (1 + error))


def _finish(priced: list, device_of, top: int) -> list[Candidate]:
    """The ``top`` best of ``priced`` ((bound, order, closed form, config, final prediction
    or None when it is to be simulated) each) by their final prediction, simulating only
    those whose bound could still enter the list."""
    priced.sort(key=lambda entry: entry[:2])
    finished: list[tuple[float, int, Candidate]] = []
    for bound, order, _, candidate, final in priced:
        if len(finished) >= top and bound > finished[top - 1][0]:
            break
        simulated = final is None
        if simulated:  # what hybrid-plan predicts for it
            final = predict_step(plan_job(candidate, lower=False), device_of(candidate))
        done = Candidate(settings_of(candidate), final, simulated=simulated)
        bisect.insort(finished, (final.step_time_s, order, done), key=lambda entry: entry[:2])
    return [final for _, _, final in finished[:top]]


def _why_cp(best: list[Candidate], priced: list, device_of) -> str | None:
    """Why the best layout splits sequences (None when it does not): no layout without
    context parallelism fits, or the best one without it (found as exactly) is slower."""
    if not best or best[0].settings["cp"] == 1:
        return None
    cp = best[0].settings["cp"]
    without = _finish([entry for entry in priced if entry[3].parallel.cp == 1], device_of, 1)
    if not without:
        return (f"cp={cp}: no layout with cp=1 fits in device memory; context parallelism "
                f"keeps 1/cp of each sequence's activations per rank")
    return (f"cp={cp}: predicted {best[0].predicted.step_time_s:.3g} s against "
            f"{without[0].predicted.step_time_s:.3g} s for the best layout with cp=1")


def _reason(message: str) -> str:
    """``parallel.tp=3 does not divide ...`` -> ``invalid parallel.tp``."""
    field = re.match(r"([\w.]+)=", message)
    return f"invalid {field[1]}" if field else message.split(";")[0]
