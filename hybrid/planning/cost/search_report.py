"""What ``hybrid-plan search.world=N`` prints (pure: no torch): the table of the best layouts
``hybrid.planning.cost.search`` found, and the one line when it found none."""

from __future__ import annotations

from hybrid.planning.cost.sizes import human_bytes


def overrides_of(settings: dict) -> list[str]:
    """The command-line overrides that select a candidate."""
    names = {"micro_batch": "train.micro_batch", "recompute": "model.recompute"}
    return [f"{names.get(key, 'parallel.' + key)}={str(value).lower()}"
            for key, value in settings.items()]


def no_layout_line(result: dict) -> str:
    """Why a search found nothing to run, as one line: the commonest reason and an instance."""
    reasons = sorted(result["rejected"].items(), key=lambda item: -item[1])
    if not reasons:
        return f"search.world={result['world']}: no layout to try"
    why, count = reasons[0]
    return (f"no layout of {result['world']} devices runs this config: {count} of "
            f"{result['considered']} have {why}, e.g. {result['examples'][why]}")


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
