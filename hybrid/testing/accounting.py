"""A finished ``hybrid-train`` run checked against its plan, for the end-to-end tests: every
rank's state and gathered bytes, rank 0's DP and context traffic per step, and ``plan.json``
against ``config.json``.

Apart from ``hybrid.testing`` (processes for a test) because this reads a run directory after
the fact and asks the planning's predictions, not torch.
"""

from __future__ import annotations


def train_checked(overrides: list[str], run_dir, timeout: float = 280) -> list[dict]:
    """Run ``hybrid-train`` with ``overrides`` in ``run_dir``; it must succeed; its
    ``metrics.jsonl`` records after ``checked_records``' accounting checks."""
    import subprocess
    import sys
    from pathlib import Path

    train = str(Path(sys.executable).parent / "hybrid-train")
    done = subprocess.run([train, *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return checked_records(run_dir)


def checked_records(run_dir) -> list[dict]:
    """A finished run's ``metrics.jsonl`` records, after checking its accounting: every rank
    held exactly the weight, gradient, optimizer and DP-option bytes the plan predicts, and
    under ZeRO-3 at its peak exactly the gathered weights it predicts (``memory_check.json``),
    and rank 0 sent over DP in each step exactly the bytes
    ``hybrid.planning.job.rank_dp_bytes`` predicts for its layout and DP options (at ``ep > 1``
    each group's apart: ``rank_dp_group_bytes``), and over its
    context group what ``hybrid.planning.cost.context_time.cp_step_bytes`` predicts; and the run
    directory's ``plan.json`` is the plan of its ``config.json`` (nothing written back)."""
    import json
    from pathlib import Path

    from hybrid.metrics import read_metrics
    from hybrid.planning.config import from_dict
    from hybrid.planning.cost.context_time import cp_step_bytes
    from hybrid.planning.job import plan_job, rank_dp_bytes, rank_dp_group_bytes
    from hybrid.planning.plan_file import load_plan

    run_dir = Path(run_dir)
    check = json.loads((run_dir / "memory_check.json").read_text())
    assert check["state_bytes_equal"], [r for r in check["ranks"]
                                        if r["counted"] != r["predicted"]][:2]
    assert check["gathered_bytes_equal"], [
        r for r in check["ranks"]
        if r["gathered_peak_bytes"] != r["predicted_gathered_bytes"]][:2]
    plan = load_plan(run_dir)
    cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    assert plan.cfg == cfg and plan.stages == plan_job(cfg, block_costs=plan.block_costs).stages
    records = read_metrics(run_dir / "metrics.jsonl")
    for record in records:
        plan = _plan_of_step(plan, record)  # pp_balance=dynamic: the split the step ran
        layers = [b for st in plan.stages_of(0) for b in st.blocks if 1 <= b <= cfg.model.layers]
        ring = cp_step_bytes(cfg, plan.layout, len(layers), plan.schedule.microbatches,
                             moe_layers=sum(cfg.model.is_moe_layer(b) for b in layers))
        predicted = rank_dp_bytes(cfg, plan, 0, record["step"],
                                  rounds=max(record.get("dp_shares", [0])) or None)
        assert abs(record["comm_bytes"]["dp"] - predicted) <= 1e-9 * predicted, \
            (record["step"], record["comm_bytes"]["dp"], predicted)
        if plan.layout.ep > 1:  # each group's: the dense buckets' and the experts' apart
            groups = rank_dp_group_bytes(cfg, plan, 0, record["step"],
                                         rounds=max(record.get("dp_shares", [0])) or None)
            counted = record["comm_bytes_dp_groups"]
            assert counted.keys() <= groups.keys() and all(
                abs(counted.get(label, 0.0) - want) <= 1e-9 * want
                for label, want in groups.items()), (record["step"], counted, groups)
        assert record["comm_bytes"]["cp"] == ring, (record["step"], record["comm_bytes"], ring)
    return records


def _plan_of_step(plan, record: dict):
    """``plan`` on the split a ``pp_balance=dynamic`` step ran (its ``pp_split``)."""
    from hybrid.planning.stage_balance import layer_counts, split_of_counts

    split = record.get("pp_split")
    if split is None or split == layer_counts([stage.blocks for stage in plan.stages]):
        return plan
    return plan.with_stage_ranges(split_of_counts(split))
