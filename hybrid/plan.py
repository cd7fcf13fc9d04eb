"""The plan of a job, as plain data: layout, rank table, groups, parameters, memory per rank.

``build_plan(cfg)`` validates the config (raising ``LayoutError``) and returns a JSON-ready dict;
``format_plan`` renders it for a terminal. Pure: no torch.
"""

from __future__ import annotations

from hybrid.config import Config
from hybrid.cost import estimate_memory, human_bytes, param_count
from hybrid.layout import Layout
from hybrid.validate import microbatches, ranks_per_node, validate_config

GROUP_KEYS = ("tp", "dp", "pp", "tp-pp", "embedding")


def stage_blocks(cfg: Config) -> list[list[list[int]]]:
    """Per pipeline rank, the block ids of each of its virtual chunks."""
    from hybrid.pipeline.plan import partition_for_config

    stages = partition_for_config(cfg)
    pp = cfg.parallel.pp
    return [[list(rng) for s, rng in enumerate(stages) if s % pp == rank] for rank in range(pp)]


def build_plan(cfg: Config) -> dict:
    layout = validate_config(cfg)
    per_node = ranks_per_node(cfg, layout)
    ranks = [{"rank": r, "node": layout.node_of(r, per_node), **layout.coords(r)}
             for r in range(layout.world_size)]
    groups = {axis: layout.groups(axis) for axis in GROUP_KEYS}
    crossing = {axis: layout.crossing_groups(axis, per_node) for axis in ("tp", "dp", "pp")}
    return {
        "world_size": layout.world_size,
        "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp,
                   "order": layout.order, "nodes": -(-layout.world_size // per_node),
                   "ranks_per_node": per_node,
                   "nodes_given": cfg.launcher.nnodes > 1
                   or cfg.launcher.nproc_per_node is not None},
        "model": {"name": cfg.model.name, "layers": cfg.model.layers,
                  "hidden": cfg.model.hidden, "heads": cfg.model.heads,
                  "vocab": cfg.model.vocab, "padded_vocab": cfg.model.padded_vocab,
                  "seq_len": cfg.model.seq_len, "params": param_count(cfg.model)},
        "batch": {"global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch,
                  "microbatches": microbatches(cfg)},
        "ranks": ranks,
        "groups": groups,
        "crossing_nodes": crossing,
        "warnings": layout.placement_warnings(per_node),
        **_pipeline_section(cfg, layout),
    }


def _pipeline_section(cfg: Config, layout: Layout) -> dict:
    from hybrid.pipeline.plan import schedule_summary

    blocks = stage_blocks(cfg)
    summary = schedule_summary(cfg)
    memory = []
    for pp_rank, chunks in enumerate(blocks):
        held = [b for chunk in chunks for b in chunk]
        est = estimate_memory(
            cfg.model, chunks, tp=layout.tp, dp=layout.dp, zero=cfg.parallel.zero,
            micro_batch=cfg.train.micro_batch, inflight=summary["schedule"]["peak_inflight"][pp_rank],
            sp=cfg.parallel.sequence_parallel, precision=cfg.train.precision,
            embedding_copy=cfg.model.tie_embeddings and 0 not in held)
        memory.append({"pp_rank": pp_rank, "params": est.params, "param_bytes": est.param_bytes,
                       "grad_bytes": est.grad_bytes, "optimizer_bytes": est.optimizer_bytes,
                       "activation_bytes": est.activation_bytes,
                       "total_bytes": est.total_bytes})
    return {"stages": summary["stages"], "schedule": summary["schedule"], "memory": memory}


SUMMARY_ABOVE_RANKS = 64
"""Above this many ranks the text plan shows the ends of the rank table and a few groups."""
SHOWN_ROWS, SHOWN_GROUPS = 8, 4


def _rank_rows(ranks: list[dict], full: bool) -> list[str]:
    def row(r: dict) -> str:
        return f"{r['rank']:>4}  {r['node']:>4}  {r['dp']:>2}  {r['tp']:>2}  {r['pp']:>2}"

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
    lines = [
        f"model {model['name']}: {model['layers']} layers, hidden {model['hidden']}, "
        f"{model['heads']} heads, vocab {model['vocab']} (padded {model['padded_vocab']}), "
        f"seq {model['seq_len']}: {model['params']:,} parameters",
        f"layout dp={lay['dp']} tp={lay['tp']} pp={lay['pp']} vpp={lay['vpp']} "
        f"order={lay['order']}: world size {plan['world_size']} on {lay['nodes']} node(s) x "
        f"{lay['ranks_per_node']}",
        f"batch: global {batch['global_batch']} = dp {lay['dp']} x {batch['microbatches']} "
        f"micro-batches x {batch['micro_batch']}",
        "", "rank  node  dp  tp  pp",
    ]
    lines += _rank_rows(plan["ranks"], full)
    lines += ["", "groups (ranks in each):"]
    names = {"tp-pp": "tp-pp (model parallel)", "embedding": "embedding (first+last stage)"}
    for axis, groups in plan["groups"].items():
        lines.append(f"  {names.get(axis, axis):<30} "
                     + _group_line(groups, full, plan["world_size"]))
    lines.append("")
    lines += _node_lines(plan)
    lines += ["", "pipeline stages:"] + [f"  {s}" for s in plan["stages"]["lines"]]
    sched = plan["schedule"]
    lines += ["", f"schedule {sched['name']}: simulated bubble {sched['bubble_fraction']:.1%}, "
                  f"peak in-flight micro-batches per pp rank {sched['peak_inflight']}"]
    lines += ["", "memory per rank (estimate)  params    weights   grads     optimizer "
                  "activations total"]
    for m in plan["memory"]:
        cells = [human_bytes(m[k]) for k in ("param_bytes", "grad_bytes", "optimizer_bytes",
                                             "activation_bytes", "total_bytes")]
        lines.append(f"  pp rank {m['pp_rank']:<17} {m['params']:<9,} " +
                     " ".join(f"{c:<9}" for c in cells))
    return "\n".join(lines)
