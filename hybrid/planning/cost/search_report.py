"""What ``hybrid-plan search.world=N`` prints (pure: no torch): the table of the best layouts
``hybrid.planning.cost.search`` found, and the one line when it found none."""

from __future__ import annotations

from hybrid.planning.cost.sizes import human_bytes
from hybrid.planning.dp_config import FLAT_KEYS, new_key


def overrides_of(settings: dict) -> list[str]:
    """The command-line overrides that select a candidate."""
    names = {"micro_batch": "train.micro_batch", "recompute": "model.recompute",
             **{flat: f"parallel.{new_key(flat)}" for flat in FLAT_KEYS}}
    return [f"{names.get(key, 'parallel.' + key)}={str(value).lower()}"
            for key, value in settings.items()]


SAID = {"does not fit in device memory": "too large for device memory"}
"""How a rejection reason reads after its count ("7392 too large for device memory")."""
BATCH_REASON = "invalid train.global_batch"


def rejected_counts(rejected: dict) -> str:
    """``7392 too large for device memory, 5856 invalid train.global_batch``, commonest first."""
    return ", ".join(f"{n} {SAID.get(why, why)}"
                     for why, n in sorted(rejected.items(), key=lambda item: -item[1]))


def no_layout_line(result: dict) -> str:
    """Why a search found nothing to run, as one line: every reason counted (they add up to
    the layouts tried), an instance of the commonest, and what to change."""
    reasons = sorted(result["rejected"].items(), key=lambda item: -item[1])
    if not reasons:
        return f"search.world={result['world']}: no layout to try"
    why = reasons[0][0]
    line = (f"no layout of {result['world']} devices runs this config: of "
            f"{result['considered']} tried, {rejected_counts(result['rejected'])}; e.g. "
            f"{result['examples'][why]}")
    advice = [a for a in (_device_advice(result), batch_advice(result)) if a]
    return line + "".join(f"; {a}" for a in advice)


def _device_advice(result: dict) -> str:
    """A model too large for ``cost.device``'s memory: the devices there are to plan for."""
    if "does not fit in device memory" not in result["rejected"]:
        return ""
    from hybrid.planning.cost.devices import PRESETS

    larger = [name for name, d in PRESETS.items()
              if not d.host and d.memory_bytes > result.get("device_memory", 0)]
    if not larger:
        return "or more devices (search.world=)"
    return (f"plan for a larger device with cost.device={larger[0]} (presets: "
            f"{', '.join(PRESETS)}; or calibrated, or a device file) or more devices")


def batch_advice(result: dict) -> str:
    """When ``train.global_batch`` rules out most layouts: the numbers and a batch to try
    (a multiple of ``search.world`` lets every dp run at micro-batch 1)."""
    ruled_out, batch = result["rejected"].get(BATCH_REASON, 0), result.get("global_batch")
    if batch is None or 2 * ruled_out <= result["considered"]:
        return ""
    world = result["world"]
    suggest = -(-max(batch, world) // world) * world
    return (f"train.global_batch={batch} rules out {ruled_out} of {result['considered']} "
            f"layouts (dp x micro_batch must divide it): try train.global_batch={suggest}, or "
            f"the model's published batch")


def format_search(result: dict) -> str:
    """The table ``hybrid-plan search.world=N`` prints, best first."""
    # an ep column for a mixture-of-experts model only (its candidates carry ep)
    experts = any("ep" in c["settings"] for c in result["candidates"])
    lines = [f"{len(result['candidates'])} best of {result['considered']} layouts for "
             f"{result['world']} devices ({result['device']}, cost.software="
             f"{result.get('software', 'hybrid')}{result.get('limits', '')}), "
             f"by predicted step time:",
             f" #   dp  cp  tp  pp{'  ep' * experts} vpp schedule          mb zero sp  "
             "recompute  step s   TFLOP/s   mem/rank"]
    for i, c in enumerate(result["candidates"], 1):
        s, p = c["settings"], c["predicted"]
        ep = f" {s['ep']:>3}" if experts else ""
        lines.append(
            f"{i:>2} {s['dp']:>4} {s['cp']:>3} {s['tp']:>3} {s['pp']:>3}{ep} {s['vpp']:>3} "
            f"{s['schedule']:<17} "
            f"{s['micro_batch']:>2} {s['zero']:>4} {'y' if s['sequence_parallel'] else 'n':>2}  "
            f"{s['recompute']:>9} {p['step_time_s']:>7.3g} "
            f"{p['tflops_per_device']:>9.4g} {human_bytes(p['mem_bytes_per_rank']):>10}")
    if result["rejected"]:
        lines.append("rejected: " + rejected_counts(result["rejected"]))
    if batch_advice(result):
        lines.append(batch_advice(result))
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
