"""Rank every layout of N devices before launch (pure: no torch): ``hybrid-plan search.world=N``.

For the config's model and global batch, every (dp, cp, tp, pp, vpp, schedule, micro-batch,
zero, sequence parallelism, recompute) that ``validate_config`` accepts is planned
(``plan_job`` with closed-form schedule shapes), dropped when its largest rank does not fit in
the device's memory, and priced (``hybrid.planning.cost.steptime``); the best are priced again with the
schedule simulated where that is cheap, and returned best first. Rejections are counted by
reason. Tensor parallelism stays inside a node (``cost.gpus_per_node``), as every production
recipe keeps it; the schedules and chunk counts tried are each spec's ``search_vpps`` (gpipe,
1F1B's time with more memory, and zb-v, gloo only, are left out). Context parallelism is tried
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
from hybrid.planning.cost.devices import Device
from hybrid.planning.cost.memory_bound import layer_params
from hybrid.planning.cost.sizes import (
    activation_bytes_per_layer, head_activation_bytes, human_bytes,
)
from hybrid.planning.job import plan_job
from hybrid.planning.schedules import SCHEDULES, schedule_spec
from hybrid.planning.schedules.shapes import closed_form_schedule
from hybrid.planning.strategies import SHARDINGS
from hybrid.planning.layout import LayoutError, valid_sizes
from hybrid.planning.cost.steptime import (
    StepPrediction, closed_form_and_bound, predict_step, simulates,
)
from hybrid.planning.validate import RECOMPUTE, valid_tp_sizes, validate_config

MICRO_BATCHES = (1, 2, 4, 8)
FP32_BYTES = 4
OUT_OF_MEMORY = "does not fit in device memory"
LOWER_STAGE_FITS = "fit at a lower ZeRO stage"
"""Why a stage that is never faster than the one below (``searched_if_less_fails``: ZeRO-3,
whose gathers come on top of ZeRO-2's traffic) is not tried on a layout."""
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
                              "bubble_s": p.bubble_s, "dp_exposed_s": p.dp_exposed_s}}


def settings_of(cfg: Config) -> dict:
    par = cfg.parallel
    experts = {"ep": par.ep} if cfg.model.experts else {}  # tried for MoE models only
    return {"dp": par.dp, "cp": par.cp, "tp": par.tp, "pp": par.pp, "vpp": par.vpp,
            **experts, "schedule": par.schedule,
            "micro_batch": cfg.train.micro_batch, "zero": par.zero,
            "sequence_parallel": par.sequence_parallel, "recompute": cfg.model.recompute}


def overrides_of(settings: dict) -> list[str]:
    """The command-line overrides that select a candidate."""
    names = {"micro_batch": "train.micro_batch", "recompute": "model.recompute"}
    return [f"{names.get(key, 'parallel.' + key)}={str(value).lower()}"
            for key, value in settings.items()]


def candidates(cfg: Config, world: int) -> Iterator[Config]:
    """Every combination of the searched settings for ``world`` devices."""
    m, launcher = cfg.model, replace(cfg.launcher, nnodes=1, nproc_per_node=None, node_rank=0)
    tps = [tp for tp in valid_tp_sizes(m) if world % tp == 0 and tp <= cfg.cost.gpus_per_node]
    # one model and train section per setting, shared by candidates (none mutates its config)
    models = {mode: replace(m, recompute=mode) for mode in RECOMPUTE}
    trains = {mb: replace(cfg.train, micro_batch=mb) for mb in MICRO_BATCHES}
    for tp in tps:
        for cp in searched_cps(m.seq_len, world // tp):
            for pp in [p for p in valid_sizes(world // (tp * cp)) if p <= m.layers]:
                dp = world // (tp * cp * pp)
                for (schedule, vpp), mb, zero, sp, recompute in _knobs(pp, dp * cp, tp):
                    for ep in searched_eps(m.experts, dp * cp, zero):
                        yield _copied(
                            cfg, launcher=launcher,
                            parallel=_copied(cfg.parallel, dp=dp, cp=cp, tp=tp, pp=pp,
                                             vpp=vpp, schedule=schedule, zero=zero,
                                             sequence_parallel=sp, ep=ep),
                            train=trains[mb], model=models[recompute])


def searched_eps(experts: int, width: int, zero: int) -> list[int]:
    """The expert-parallel sizes tried: 1, and for a model with experts every size dividing
    both its experts and ``dp * cp`` (not with ZeRO-3, which ep does not run with)."""
    if not experts or zero == 3:
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


def searched_schedules(pp: int) -> list[tuple[str, int]]:
    """(schedule, vpp) pairs the search tries: every registered schedule's ``search_vpps``;
    with one stage every schedule runs alike, so only the first."""
    found = [(name, vpp) for name, spec in SCHEDULES.items() for vpp in spec.search_vpps]
    return found if pp > 1 else found[:1]


def searched_shardings() -> list[int]:
    """The ZeRO stages the search tries with dp > 1: those whose spec says ``searched``."""
    return [stage for stage, spec in SHARDINGS.items() if spec.searched]


def _knobs(pp: int, dp: int, tp: int) -> Iterator[tuple]:
    for schedule in searched_schedules(pp):
        for mb in MICRO_BATCHES:
            for zero in (searched_shardings() if dp > 1 else (0,)):
                for sp in ((False, True) if tp > 1 else (False,)):
                    for recompute in RECOMPUTE:
                        yield schedule, mb, zero, sp, recompute


def search(cfg: Config, world: int, device: Device, top: int = 10) -> dict:
    """``{"candidates": [...], "rejected": {reason: count}, "considered": n}``, best first.

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
    for order, candidate in enumerate(candidates(cfg, world)):
        layout_key, spec = _without_zero(candidate), SHARDINGS[candidate.parallel.zero]
        skip = spec.searched_if_less_fails and _skipped(spec, lower.get(layout_key), device)
        if skip:
            rejected[skip] += 1
            continue
        try:
            _validate_once(candidate, verdicts)
            if _memory_floor(candidate) > device.memory_bytes:  # no need to plan it
                rejected[OUT_OF_MEMORY] += 1
                continue
            plan = plan_job(candidate, simulated=False)
        except LayoutError as err:
            rejected[_reason(str(err))] += 1
            examples.setdefault(_reason(str(err)), str(err))
            continue
        lower[layout_key] = plan
        if max(est.total_bytes for est in plan.memory) > device.memory_bytes:
            rejected[OUT_OF_MEMORY] += 1
            continue
        if simulates(plan):  # finished in the order of its bound, if it can enter the list
            closed, bound = closed_form_and_bound(plan, device)
            priced.append((bound, order, closed, candidate, None))
        else:  # the closed form is final: no bound needed
            closed = predict_step(plan, device, simulated=False)
            priced.append((closed.step_time_s, order, closed, candidate, closed))
    best = _finish(priced, device, max(1, top))
    considered = len(priced) + sum(rejected.values())
    return {"world": world, "device": device.name, "considered": considered,
            "simulated": sum(1 for c in best if c.simulated),
            "within_error_of_best": _within_error(best[:top], device.error_fraction),
            "error_fraction": device.error_fraction,
            "candidates": [c.to_dict() for c in best[:top]], "rejected": dict(rejected),
            "examples": examples,
            "why_cp": _why_cp(best, priced, device)}


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


def _memory_floor(candidate: Config) -> int:
    """Bytes some rank of a valid ``candidate`` holds at least, by ``estimate_memory``'s own
    terms: the pipeline rank with the most layers holds ``layers / pp`` or more, and with the
    uniform partition every virtual stage holds ``layers // (pp * vpp)`` or more, so the first
    rank holds that many in each chunk with its schedule's peak of micro-batches in flight,
    and the rank with the head as many and the head's activations for the micro-batches its
    schedule holds; ZeRO-3 gathers at least one layer's weights whole (norms, biases,
    embeddings, padding and more micro-batches in flight only add). A layout over it is
    rejected for memory without being planned: most of a large model's layouts."""
    m, par, mb = candidate.model, candidate.parallel, candidate.train.micro_batch
    precision, sp = candidate.train.precision, par.sequence_parallel
    per_layer = activation_bytes_per_layer(m, mb, par.tp, sp, precision, m.recompute, par.cp)
    working = (activation_bytes_per_layer(m, mb, par.tp, sp, precision, cp=par.cp)
               if m.recompute == "full" else 0)
    weights = layer_params(m)
    if SHARDINGS[par.zero].gathers_params:  # a layer's weights gathered whole, at least
        working += int(FP32_BYTES * weights / par.tp)

    def held(layers: float, chunk_layers: float, inflight: int) -> int:
        state = SHARDINGS[par.zero].closed_form_state(int(layers * weights / par.tp),
                                                      par.dp * par.cp)
        return (state.param_bytes + state.grad_bytes + state.optimizer_bytes
                + int(chunk_layers * per_layer * inflight) + working)

    most = held(m.layers / par.pp, m.layers / par.pp / par.vpp, 1)
    if par.partition != "uniform":
        return most
    each = m.layers // (par.pp * par.vpp)
    microbatches = candidate.train.global_batch // (par.dp * mb)
    first = closed_form_schedule(par.schedule, par.pp, microbatches, par.vpp)[1][0]
    # the rank with the head keeps its activations for the micro-batches the schedule holds
    head = (schedule_spec(par.schedule).last_stage_holds(microbatches)
            * head_activation_bytes(m, mb, par.tp, sp, precision, par.cp))
    return max(most, held(each * par.vpp, each, first), held(each * par.vpp, each, 1) + head)


def _skipped(spec, lower, device: Device) -> str | None:
    """Why a stage tried only where lower ones fail is not tried on a layout: a lower stage
    fits (it is never faster), or even its memory floor, from the lower stage's plan, does
    not (then planning it is wasted: most of a large model's layouts)."""
    if lower is None:
        return None
    totals = [est.total_bytes for est in lower.memory]
    if max(totals) <= device.memory_bytes:
        return LOWER_STAGE_FITS
    d = lower.layout.role_size("sharding")
    if min(spec.memory_floor(est, d) for est in lower.memory) > device.memory_bytes:
        return OUT_OF_MEMORY
    return None


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


def _finish(priced: list, device: Device, top: int) -> list[Candidate]:
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
            final = predict_step(plan_job(candidate), device)
        done = Candidate(settings_of(candidate), final, simulated=simulated)
        bisect.insort(finished, (final.step_time_s, order, done), key=lambda entry: entry[:2])
    return [final for _, _, final in finished[:top]]


def no_layout_line(result: dict) -> str:
    """Why a search found nothing to run, as one line: the commonest reason and an instance."""
    reasons = sorted(result["rejected"].items(), key=lambda item: -item[1])
    if not reasons:
        return f"search.world={result['world']}: no layout to try"
    why, count = reasons[0]
    return (f"no layout of {result['world']} devices runs this config: {count} of "
            f"{result['considered']} have {why}, e.g. {result['examples'][why]}")


def _why_cp(best: list[Candidate], priced: list, device: Device) -> str | None:
    """Why the best layout splits sequences (None when it does not): no layout without
    context parallelism fits, or the best one without it (found as exactly) is slower."""
    if not best or best[0].settings["cp"] == 1:
        return None
    cp = best[0].settings["cp"]
    without = _finish([entry for entry in priced if entry[3].parallel.cp == 1], device, 1)
    if not without:
        return (f"cp={cp}: no layout with cp=1 fits in device memory; context parallelism "
                f"keeps 1/cp of each sequence's activations per rank")
    return (f"cp={cp}: predicted {best[0].predicted.step_time_s:.3g} s against "
            f"{without[0].predicted.step_time_s:.3g} s for the best layout with cp=1")


def _reason(message: str) -> str:
    """``parallel.tp=3 does not divide ...`` -> ``invalid parallel.tp``."""
    field = re.match(r"([\w.]+)=", message)
    return f"invalid {field[1]}" if field else message.split(";")[0]


def format_search(result: dict) -> str:
    """The table ``hybrid-plan search.world=N`` prints, best first."""
    lines = [f"{len(result['candidates'])} best of {result['considered']} layouts for "
             f"{result['world']} devices ({result['device']}), by predicted step time:",
             " #   dp  cp  tp  pp vpp schedule          mb zero sp  recompute  step s   "
             "TFLOP/s   mem/rank"]
    for i, c in enumerate(result["candidates"], 1):
        s, p = c["settings"], c["predicted"]
        lines.append(
            f"{i:>2} {s['dp']:>4} {s['cp']:>3} {s['tp']:>3} {s['pp']:>3} {s['vpp']:>3} "
            f"{s['schedule']:<17} "
            f"{s['micro_batch']:>2} {s['zero']:>4} {'y' if s['sequence_parallel'] else 'n':>2}  "
            f"{s['recompute']:>9} {p['step_time_s']:>7.3g} "
            f"{p['tflops_per_device']:>9.4g} {human_bytes(p['mem_bytes_per_rank']):>10}")
    if result["rejected"]:
        lines.append("rejected: " + ", ".join(f"{n} {why}" for why, n in
                                              sorted(result["rejected"].items())))
    if result.get("why_cp"):
        lines.append("why " + result["why_cp"])
    if result.get("assumes"):
        lines.append(result["assumes"])
    tied = result.get("within_error_of_best")
    if tied and tied > 1:
        which = (f"all {tied} printed are" if tied == len(result["candidates"])
                 else f"the first {tied} are")
        lines.append(f"{which} within the model's measured error "
                     f"({result['error_fraction']:.0%}) of the best: it cannot rank them; "
                     f"measure them (search.run=true)")
    if result.get("run_best"):  # the whole command, from hybrid-plan's own overrides
        lines.append(f"run the best: {result['run_best']}")
    elif result["candidates"]:
        lines.append("run the best: hybrid-train " + " ".join(
            overrides_of(result["candidates"][0]["settings"])))
    return "\n".join(lines)
