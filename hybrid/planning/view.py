"""``hybrid-plan``'s view of a job's plan (``hybrid.planning.job``): layout, rank table, groups,
parameters, memory per rank, as plain data.

``build_plan(cfg)`` validates the config (raising ``LayoutError``) and returns a JSON-ready dict;
``format_plan`` renders it for a terminal. Pure: no torch.
"""

from __future__ import annotations

from hybrid.planning.config import Config
from hybrid.planning.cost.moe_traffic import a2a_step_bytes
from hybrid.planning.cost.sizes import human_bytes, param_count, published_param_count
from hybrid.planning.job import JobPlan, plan_job
from hybrid.planning.layout import AXIS_TRAFFIC
from hybrid.planning.models.moe import expert_bias_payload
from hybrid.planning.strategies import all_reduce_bytes
from hybrid.planning.cost.block_costs import partition_basis
from hybrid.planning.schedules.check import format_table
from hybrid.planning.schedules.shapes import checked_schedule, schedule_steps
from hybrid.planning.schedules.partition import format_partition

GROUP_KEYS = ("tp", "cp", "dp", "cp-dp", "pp", "tp-pp", "embedding", "ep", "edp", "tp-ep-pp")
"""The groups shown, each once (roles over the same axes share one); those over ``cp`` only
when it is above 1, the expert grid's (``hybrid.planning.expert_grid``) when ``ep`` is."""


def shown_group_keys(layout) -> list[str]:
    return [key for key in GROUP_KEYS
            if (layout.cp > 1 or "cp" not in key.split("-"))
            and (layout.ep > 1 or not {"ep", "edp"} & set(key.split("-")))]


def _experts(plan: JobPlan) -> dict:
    """Expert parallelism's figures: ``ep``, and the all-to-all bytes a rank of each pipeline
    rank sends per step at an even load (``hybrid.planning.cost.moe_traffic``)."""
    cfg, layout = plan.cfg, plan.layout
    per_pp, bias = [], []
    for r in range(layout.pp):
        blocks = [b for st in plan.stages_of(r) for b in st.blocks]
        moe = sum(cfg.model.is_moe_layer(b) for b in blocks if 1 <= b <= cfg.model.layers)
        per_pp.append(a2a_step_bytes(cfg, layout, moe, plan.schedule.microbatches))
        bias.append(all_reduce_bytes(expert_bias_payload(cfg.model, blocks),
                                     layout.role_size("loss")))
    return {"ep": layout.ep, "experts": cfg.model.moe.experts,
            "a2a_bytes_per_step": per_pp, "expert_bias_bytes_per_step": bias}


def build_plan(cfg: Config) -> dict:
    """``plan_job(cfg)`` as JSON-ready data (``hybrid-plan format=json``)."""
    return plan_dict(plan_job(cfg))


def plan_dict(plan: JobPlan) -> dict:
    cfg, layout, per_node = plan.cfg, plan.layout, plan.ranks_per_node
    ranks = [{"rank": r, "node": plan.node_of(r), **layout.coords(r)}
             for r in range(layout.world_size)]
    sched = plan.schedule
    return {
        "world_size": layout.world_size,
        "layout": {"dp": layout.dp, "cp": layout.cp, "tp": layout.tp, "pp": layout.pp,
                   "vpp": layout.vpp, "ep": layout.ep,
                   "order": layout.order, "nodes": plan.nodes, "ranks_per_node": per_node,
                   "nodes_given": cfg.launcher.nnodes > 1
                   or cfg.launcher.nproc_per_node is not None},
        "model": {"name": cfg.model.name, "layers": cfg.model.layers,
                  "hidden": cfg.model.hidden, "heads": cfg.model.heads,
                  "vocab": cfg.model.vocab, "padded_vocab": cfg.model.padded_vocab,
                  "seq_len": cfg.model.seq_len, "params": published_param_count(cfg.model),
                  "params_padded": param_count(cfg.model)},
        "batch": {"global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch,
                  "microbatches": sched.microbatches},
        "ranks": ranks,
        "groups": {axis: layout.groups(axis) for axis in shown_group_keys(layout)},
        "crossing_nodes": {axis: layout.crossing_groups(axis, per_node)
                           for axis in shown_group_keys(layout) if axis in AXIS_TRAFFIC},
        "warnings": layout.placement_warnings(per_node),
        "stages": {"partition": cfg.parallel.partition,
                   "split_by": partition_basis(cfg.parallel.partition, plan.costs_measured),
                   "blocks": [list(st.blocks) for st in plan.stages],
                   "lines": format_partition(
                       [st.blocks for st in plan.stages], layout.pp, cfg.model.layers,
                       placement=layout.stage_placement).splitlines()},
        "schedule": {"name": sched.name, "microbatches": sched.microbatches,
                     "bubble_fraction": sched.bubble_fraction,
                     "bubble_fraction_per_rank": list(sched.bubble_per_rank),
                     "peak_inflight": list(sched.peak_inflight),
                     "steps": _steps(plan)},
        "experts": _experts(plan),
        "memory": [{"pp_rank": r, "params": est.params, "param_bytes": est.param_bytes,
                    "grad_bytes": est.grad_bytes, "optimizer_bytes": est.optimizer_bytes,
                    "activation_bytes": est.activation_bytes,
                    "dp_state_bytes": est.dp_state_bytes, "total_bytes": est.total_bytes}
                   for r, est in enumerate(plan.memory)],
    }


def _steps(plan: JobPlan) -> list[list[str]]:
    """Each pipeline rank's compute actions in order, a composite whole (``0F3+3B1``)."""
    layout, m = plan.layout, plan.schedule.microbatches
    shape = (plan.schedule.name, layout.pp, m, layout.vpp)
    steps = schedule_steps(*shape) or checked_schedule(*shape)
    return [[str(step) for step in rank_steps] for rank_steps in steps]


SUMMARY_ABOVE_RANKS = 64
"""Above this many ranks the text plan shows the ends of the rank table and a few groups."""
SHOWN_ROWS, SHOWN_GROUPS = 8, 4


def _rank_rows(ranks: list[dict], full: bool) -> list[str]:
    with_cp = any(r["cp"] for r in ranks)

    def row(r: dict) -> str:
        cp = f"  {r['cp']:>2}" if with_cp else ""
        return f"{r['rank']:>4}  {r['node']:>4}  {r['dp']:>2}{cp}  {r['tp']:>2}  {r['pp']:>2}"

    if full or len(ranks) <= SUMMARY_ABOVE_RANKS:
        return [row(r) for r in ranks]
    hidden = len(ranks) - 2 * SHOWN_ROWS
    return ([row(r) for r in ranks[:SHOWN_ROWS]]
            + [f"   ... {hidden} more ranks (full=true prints them all) ..."]
            + [row(r) for r in ranks[-SHOWN_ROWS:]])


def _group_line(groups: list[list[int]], full: bool, world: int) -> str:
    if full or world <= SUMMARY_ABOVE_RANKS or len(groups) <= SHOWN_GROUPS:
        return " ".join(map(str, groups))
    return (" ".join(map(str, groups[:SHOWN_GROUPS]))
            + f" ... ({len(groups)} groups of {len(groups[0])})")


def _node_lines(plan: dict) -> list[str]:
    if plan["warnings"]:
        return [f"warning: {w}" for w in plan["warnings"]]
    lay = plan["layout"]
    if lay["nodes"] == 1 and not lay["nodes_given"] and plan["world_size"] > 1:
        return [f"all {plan['world_size']} ranks are planned on one node (launcher.nnodes=1): "
                f"set launcher.nnodes and launcher.nproc_per_node to see which groups cross "
                f"nodes"]
    return ["no group crosses a node"]


def format_plan(plan: dict, full: bool = False) -> str:
    lay, model, batch = plan["layout"], plan["model"], plan["batch"]
    cp = f" cp={lay['cp']}" if lay["cp"] > 1 else ""
    cp += f" ep={lay['ep']}" if lay.get("ep", 1) > 1 else ""
    lines = [
        f"model {model['name']}: {model['layers']} layers, hidden {model['hidden']}, "
        f"{model['heads']} heads, vocab {model['vocab']} (padded {model['padded_vocab']}), "
        f"seq {model['seq_len']}: {model['params']:,} parameters" + (
            f" ({model['params_padded']:,} with the padded vocabulary)"
            if model["params_padded"] != model["params"] else ""),
        f"layout dp={lay['dp']}{cp} tp={lay['tp']} pp={lay['pp']} vpp={lay['vpp']} "
        f"order={lay['order']}: world size {plan['world_size']} on {lay['nodes']} node(s) x "
        f"{lay['ranks_per_node']}",
        f"batch: global {batch['global_batch']} = dp {lay['dp']} x {batch['microbatches']} "
        f"micro-batches x {batch['micro_batch']}",
        "", "rank  node  dp  " + "cp  " * (lay["cp"] > 1) + "tp  pp",
    ]
    lines += _rank_rows(plan["ranks"], full)
    lines += ["", "groups (ranks in each):"]
    names = {"tp-pp": "tp-pp (model parallel)", "embedding": "embedding (first+last stage)",
             "cp": "cp (context: attention's ring)", "cp-dp": "cp-dp (gradients, loss, ZeRO)",
             "ep": "ep (experts' all-to-all)", "edp": "edp (experts' gradients, ZeRO)",
             "tp-ep-pp": "tp-ep-pp (experts' norm)"}
    for axis, groups in plan["groups"].items():
        lines.append(f"  {names.get(axis, axis):<30} "
                     + _group_line(groups, full, plan["world_size"]))
    lines.append("")
    experts = plan.get("experts", {})
    if experts.get("ep", 1) > 1:
        sent = ", ".join(human_bytes(b) for b in experts["a2a_bytes_per_step"])
        lines += [f"experts: {experts['experts']} per MoE layer over ep={experts['ep']}; "
                  f"all-to-all per rank per step at an even load (per pp rank): {sent}", ""]
    if any(experts.get("expert_bias_bytes_per_step", [])):
        sent = ", ".join(human_bytes(b) for b in experts["expert_bias_bytes_per_step"])
        lines += [f"expert bias: its counts' all-reduce over dp x cp per rank per step (DP "
                  f"traffic, per pp rank): {sent}", ""]
    lines += _node_lines(plan)
    stages = plan["stages"]
    lines += ["", f"pipeline stages (partition={stages['partition']}, by {stages['split_by']}):"]
    lines += [f"  {s}" for s in stages["lines"]]
    sched = plan["schedule"]
    lines += ["", f"schedule {sched['name']}: simulated bubble {sched['bubble_fraction']:.1%}, "
                  f"peak in-flight micro-batches per pp rank {sched['peak_inflight']}"]
    if full:  # the schedule drawn: step x rank ("+" joins a composite's overlapped parts)
        lines += ["", *format_table(sched["steps"]).splitlines()]
    lines += ["", "memory per rank (estimate)  params    weights   grads     optimizer "
                  "activations total"]
    for m in plan["memory"]:
        cells = [human_bytes(m[k]) for k in ("param_bytes", "grad_bytes", "optimizer_bytes",
                                             "activation_bytes", "total_bytes")]
        lines.append(f"  pp rank {m['pp_rank']:<17} {m['params']:<9,} " +
                     " ".join(f"{c:<9}" for c in cells))
        if m["dp_state_bytes"]:
            lines.append(f"    (total includes {human_bytes(m['dp_state_bytes'])} the DP "
                         f"option keeps: error feedback or gradients in flight)")
    return "\n".join(lines)
