"""What ``hybrid-plan`` says of a mixed cluster (``cost.node_devices``; pure: no torch).

``mixed_prediction``: each node's device and the stages it runs, the step with the layers
split by the devices' speeds against the same layout split as the config says (uniform by
default), and against each uniform cluster of the devices named. ``mixed_search``: the
layouts ranked on the mixed cluster: the search's best layouts on each uniform cluster, each
planned and priced again on the mix (``hybrid.planning.cost.mixed``), with what the mix costs
against the best uniform cluster.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from hybrid.planning.config import Config
from hybrid.planning.cost.devices import load_device
from hybrid.planning.cost.mixed import MixedPlan, cluster, mixed_step, plan_mixed
from hybrid.planning.cost.search import search
from hybrid.planning.cost.search_report import overrides_of
from hybrid.planning.cost.sizes import human_bytes
from hybrid.planning.cost.steptime import predict_step
from hybrid.planning.memory import plan_need

SHORTLIST = 12
"""Layouts taken from each uniform cluster's search to price on the mix."""


def node_rows(mixed: MixedPlan) -> list[dict]:
    """Per node: its device, and the pipeline ranks it holds with their layers."""
    plan = mixed.plan
    layout, per_node, layers = plan.layout, plan.priced_ranks_per_node, plan.cfg.model.layers
    rows = []
    for node, device in enumerate(mixed.nodes):
        ranks = range(node * per_node, min(layout.world_size, (node + 1) * per_node))
        pps = sorted({layout.coords(r)["pp"] for r in ranks})
        rows.append({"node": node, "device": device.name, "pp_ranks": pps,
                     "layers": [sum(1 for st in plan.stages_of(p) for b in st.blocks
                                    if 1 <= b <= layers) for p in pps],
                     "blocks": [[[st.blocks.start, st.blocks.stop - 1]
                                 for st in plan.stages_of(p)] for p in pps]})
    return rows


def mixed_prediction(mixed: MixedPlan) -> dict:
    """The mixed cluster's prediction for ``hybrid-plan`` (JSON-ready but ``slowest``: the
    slowest replica's ``StepPrediction``)."""
    split = mixed_step(mixed.plan, mixed.link, mixed.grid)
    uniform = mixed_step(mixed.uniform, mixed.link, mixed.grid)
    names = list(dict.fromkeys(d.name for d in mixed.nodes))
    alone = {d.name: predict_step(mixed.uniform, d).step_time_s for d in mixed.nodes}
    best = min(names, key=alone.__getitem__)
    return {"nodes": node_rows(mixed), "links_on": mixed.link.name,
            "step_time_s": split["step_time_s"], "even_step_s": split["even_step_s"],
            "shares": split["shares"], "partition": mixed.plan.cfg.parallel.partition,
            "config_split_step_s": uniform["step_time_s"],
            "uniform_clusters": {name: alone[name] for name in names},
            "best_uniform": best, "mix_vs_best_uniform": split["step_time_s"] / alone[best],
            "slowest": split["slowest"]}


def with_mixed(plan: dict, mixed: MixedPlan) -> dict:
    """``hybrid-plan``'s plan data for ``mixed.plan`` with the mixed cluster's sections: what
    split the stages, the memory check against the smallest node's memory (the split is held
    to it, ``PULLS``), and ``mixed_prediction`` (``slowest`` still in it)."""
    if mixed.pull is not None:
        plan["stages"]["split_by"] = (f"each stage's device's predicted seconds "
                                      f"(cost.node_devices, pull {mixed.pull:g})")
    need = plan_need(mixed.plan, "cpu" if any(d.host for d in mixed.nodes) else "gpu")
    limit = min(d.memory_bytes for d in mixed.nodes)
    smallest = min(mixed.nodes, key=lambda d: d.memory_bytes).name
    fits = need.needed_bytes <= limit
    plan["memory_check"] = {
        "needed_bytes": need.needed_bytes, "limit_bytes": limit, "device": smallest,
        "fits": fits, "line": f"{'fits' if fits else 'does not fit'}: needs about "
        f"{human_bytes(need.needed_bytes)} (rank {need.rank}) of {human_bytes(limit)} "
        f"({smallest}, the smallest node's memory)"}
    plan["mixed_nodes"] = mixed_prediction(mixed)
    return plan


def mixed_lines(p: dict) -> str:
    """``hybrid-plan``'s lines for ``mixed_prediction``."""
    lines = [p["node_groups"]] if p.get("node_groups") else []
    lines.append("nodes (cost.node_devices; layers split by each stage's device, "
                 "hybrid/planning/cost/mixed.py):")
    for row in p["nodes"]:
        held = ", ".join(f"pp rank {r}: {n} layers" for r, n in zip(row["pp_ranks"],
                                                                     row["layers"]))
        lines.append(f"  node {row['node']}: {row['device']:<10} {held}")
    shares = "" if len(set(p["shares"])) <= 1 else (
        f" with parallel.dp_balance=dynamic's shares {p['shares']} (even shares: "
        f"{p['even_step_s']:.4g} s)")
    lines.append(f"mixed cluster: step {p['step_time_s']:.4g} s{shares}; the same layout "
                 f"split as parallel.partition={p['partition']} says: "
                 f"{p['config_split_step_s']:.4g} s "
                 f"({p['step_time_s'] / p['config_split_step_s']:.2f}x); links priced on "
                 f"{p['links_on']}")
    alone = ", ".join(f"all {name}: {s:.4g} s" for name, s in p["uniform_clusters"].items())
    lines.append(f"uniform clusters of this layout: {alone}; the mix costs "
                 f"{p['mix_vs_best_uniform'] - 1:+.0%} against all {p['best_uniform']}")
    return "\n".join(lines)


def config_of(cfg: Config, settings: dict) -> Config:
    """The config a search's ``settings`` select (as ``search.candidates`` builds it)."""
    keys = ("dp", "cp", "tp", "pp", "vpp", "schedule", "zero", "sequence_parallel", "ep")
    return replace(cfg, launcher=replace(cfg.launcher, nnodes=1, nproc_per_node=None,
                                         node_rank=0),
                   parallel=replace(cfg.parallel, **{k: settings[k] for k in keys
                                                     if k in settings}),
                   train=replace(cfg.train, micro_batch=settings["micro_batch"]),
                   model=replace(cfg.model, recompute=settings["recompute"]))


def _priced_on_mix(cfg: Config, settings: dict, software) -> Optional[dict]:
    """One layout on the mixed cluster, or None when a rank does not fit its memory."""
    candidate = config_of(cfg, settings)
    nodes = cluster(candidate, software, candidate.parallel.pp)  # its ranks' nodes
    mixed = plan_mixed(candidate, nodes)
    if max(est.total_bytes for est in mixed.plan.memory) > min(d.memory_bytes for d in nodes):
        return None
    step = mixed_step(mixed.plan, mixed.link, mixed.grid)
    layers = candidate.model.layers
    split = [f"{sum(1 for st in mixed.plan.stages_of(p) for b in st.blocks if 1 <= b <= layers)}"
             f"@{_names(row[p] for row in mixed.grid)}" for p in range(mixed.plan.layout.pp)]
    shares = {}  # the replicas' shares by the devices they run on
    for row, share in zip(mixed.grid, step["shares"]):
        shares.setdefault(_names(row), share)
    return {"settings": settings, "step_time_s": step["step_time_s"],
            "even_shares": len(set(step["shares"])) == 1,
            "split": " ".join(split), "shares": shares}


def _names(devices) -> str:
    return "+".join(dict.fromkeys(d.name for d in devices))


def mixed_search(cfg: Config, world: int, software, top: int, limits) -> dict:
    """The layouts of ``world`` devices ranked on ``cfg.cost.node_devices``'s nodes."""
    names = list(dict.fromkeys(str(n) for n in cfg.cost.node_devices))
    uniform, settings = {}, {}
    for name in names:
        result = search(cfg, world, load_device(name), top=max(top, SHORTLIST), limits=limits)
        uniform[name] = result["candidates"]
        for row in result["candidates"]:
            settings.setdefault(tuple(sorted(row["settings"].items())), row["settings"])
    priced = [p for p in (_priced_on_mix(cfg, s, software) for s in settings.values()) if p]
    priced.sort(key=lambda p: p["step_time_s"])
    for p in priced:  # where each uniform cluster's search placed it (1: its best)
        p["uniform_rank"] = {name: next((i + 1 for i, row in enumerate(rows)
                                         if row["settings"] == p["settings"]), None)
                             for name, rows in uniform.items()}
    on_mix = {tuple(sorted(p["settings"].items())): p["step_time_s"] for p in priced}
    bests = {name: {"settings": rows[0]["settings"],
                    "step_time_s": rows[0]["predicted"]["step_time_s"],
                    "on_mix_s": on_mix.get(tuple(sorted(rows[0]["settings"].items())))}
             for name, rows in uniform.items() if rows}
    return {"world": world, "node_devices": list(map(str, cfg.cost.node_devices)),
            "candidates": priced[:top], "uniform_best": bests}


def mixed_search_lines(result: dict) -> str:
    """``hybrid-plan search.world=N cost.node_devices=[...]``'s table and its reason."""
    names = list(result["uniform_best"])
    lines = [f"best layouts of {result['world']} devices on nodes "
             f"{result['node_devices']} (cost.node_devices): layers per pipeline rank @ its "
             f"device, micro-batches per replica by device, and the rank each layout had on "
             f"each uniform cluster ({', '.join(names)}; - : not in its best {SHORTLIST})",
             "  step s    layers@device                    shares            ranks  layout"]
    for p in result["candidates"]:
        shares = "even" if p["even_shares"] else " ".join(
            f"{k.split('-')[0]}:{v}" for k, v in p["shares"].items())
        ranks = "/".join(str(p["uniform_rank"][n] or "-") for n in names)
        balance = [] if p["even_shares"] else ["parallel.dp_balance=dynamic"]
        lines.append(f"  {p['step_time_s']:<9.4g} {p['split']:<32} {shares:<17} {ranks:<6} "
                     f"{' '.join(overrides_of(p['settings']) + balance)}")
    if not result["candidates"]:
        return lines[0] + "\n  none fits every node's memory"
    first = result["candidates"][0]
    for name, best in result["uniform_best"].items():
        on_mix = best["on_mix_s"]
        mix = f"{on_mix:.4g} s on the mix" if on_mix is not None else "does not fit the mix"
        lines.append(f"all {name}: its best layout {best['step_time_s']:.4g} s; {mix}")
    fastest = min(result["uniform_best"].items(), key=lambda kv: kv[1]["step_time_s"])
    lines.append(f"the mix's best costs "
                 f"{first['step_time_s'] / fastest[1]['step_time_s'] - 1:+.0%} against the best "
                 f"uniform cluster (all {fastest[0]}, {fastest[1]['step_time_s']:.4g} s): its "
                 f"slower nodes hold back the stages or replicas they run")
    return "\n".join(lines)
