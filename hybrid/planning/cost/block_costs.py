"""What ``parallel.partition=measured`` balances: one cost per block (pure; no torch).

The costs are seconds of forward + backward per block (embedding, each layer, head and loss),
timed on the ranks before training (``hybrid.pipeline.calibrate``) or read from a calibration
file that an earlier run wrote. Until they are known (``hybrid-plan`` of a job that has not run
yet) the cost model's FLOPs stand in, so a plan can still be printed.

A calibration file records what the costs were measured for; a file measured for another
model, micro-batch, precision, TP size or device is refused rather than silently reused, since
its costs would balance a different job.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from hybrid.planning.config import Config
from hybrid.planning.cost.flops import block_forward_flops, head_forward_flops
from hybrid.files import write_text
from hybrid.planning.layout import LayoutError
from hybrid.planning.models.layers import layer_specs
from hybrid.planning.cost.sizes import block_params
from hybrid.planning.schedules.partition import block_names, partition

FILE_NAME = "block_costs.json"
"""The calibration file in the run directory when ``parallel.partition_file`` is not set."""


def partition_costs(cfg: Config, measured: Optional[list[float]] = None
                    ) -> tuple[list[float], bool]:
    """(per-block cost for the partitioner, whether it is known). balanced: parameters on
    one TP rank (the head's output matrix counts even when tied, since the last stage computes
    with it). measured: ``measured`` seconds of forward + backward, else
    ``parallel.block_costs``, else the cost model's FLOPs until the ranks measure (not known)."""
    if cfg.parallel.partition == "measured":
        for known in (measured, cfg.parallel.block_costs):
            if known is not None:
                return [float(c) for c in known], True
        return predicted_block_costs(cfg), False
    return [float(b.total) for b in block_params(cfg.model, head_owns_embedding_copy=True)], True


def partition_for_config(cfg: Config, costs: Optional[list[float]] = None) -> list[range]:
    """Contiguous block ranges, one per virtual stage in model order."""
    par = cfg.parallel
    costs = partition_costs(cfg)[0] if costs is None else costs
    return partition(costs, par.pp, par.vpp, mode=par.partition)


def predicted_block_costs(cfg: Config) -> list[float]:
    """Forward + backward FLOPs per block from the cost model (``hybrid.planning.cost.steptime``): a stand-in
    for measured seconds (the embedding's gather counts as nothing). Each layer its own kind's
    (an MoE layer's differ from a dense one's), so the stages balance by them."""
    m, b = cfg.model, cfg.train.micro_batch
    layers = [3 * block_forward_flops(m, b, block) for block in range(1, m.layers + 1)]
    return [0.0] + layers + [3 * head_forward_flops(m, b)]


def partition_basis(partition: str, costs_measured: bool) -> str:
    """What stages were split by, in words (``hybrid-plan`` prints it)."""
    if partition == "uniform":
        return "layer count"
    if partition == "balanced":
        return "parameters"
    if costs_measured:
        return "measured seconds"
    return "predicted FLOPs until the ranks measure, before training"


def measured_for(cfg: Config) -> dict:
    """What a block's time depends on; a calibration file is reused only when this matches."""
    m = cfg.model
    return {"layers": m.layers, "hidden": m.hidden, "heads": m.heads, "ffn": m.ffn,
            "padded_vocab": m.padded_vocab, "seq_len": m.seq_len,
            "tie_embeddings": m.tie_embeddings, "recompute": m.recompute,
            "micro_batch": cfg.train.micro_batch, "precision": cfg.train.precision,
            "tp": cfg.parallel.tp, "sequence_parallel": cfg.parallel.sequence_parallel,
            "device": cfg.train.device, **_moe_measured_for(m)}


def _moe_measured_for(m) -> dict:
    """With experts, what an MoE layer's time depends on too, and which layers are MoE
    (nothing for a dense model, whose record stays as it was)."""
    if not m.moe.experts:
        return {}
    return {"experts": m.moe.experts, "experts_topk": m.moe.topk, "moe_ffn": m.moe_ffn,
            "moe_shared_ffn_hidden": m.moe.shared_ffn_hidden,
            "layer_kinds": [spec.kind for spec in layer_specs(m)]}


def calibration_record(cfg: Config, forward_s: list[float], backward_s: list[float],
                       ranks: int, how: str) -> dict:
    """The calibration file's content (also what the run directory keeps of the measurement)."""
    return {"measured_for": measured_for(cfg),
            "blocks": block_names(len(forward_s)),
            "forward_s": forward_s, "backward_s": backward_s,
            "cost_s": [f + b for f, b in zip(forward_s, backward_s)],
            "ranks": ranks, "how": how}


def write_calibration(path: str | Path, record: dict) -> None:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(record, indent=1) + "\n")


def read_calibration(path: str | Path, cfg: Config) -> list[float]:
    """The per-block costs of a calibration file measured for this job; ``LayoutError``
    (one line) when it cannot be read or was measured for something else."""
    try:
        record = json.loads(Path(path).expanduser().read_text())
        costs, recorded_for = [float(c) for c in record["cost_s"]], record["measured_for"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise LayoutError(f"parallel.partition_file={path} cannot be read as block costs "
                          f"({err}); delete it so that the ranks measure again") from None
    expected = measured_for(cfg)
    changed = [f"{key}={recorded_for.get(key)!r} (now {value!r})"
               for key, value in expected.items() if recorded_for.get(key) != value]
    if changed:
        raise LayoutError(f"parallel.partition_file={path} was measured for another job: "
                          f"{', '.join(changed)}; delete it or name another file to measure "
                          f"again")
    if len(costs) != cfg.model.layers + 2 or not all(math.isfinite(c) and c >= 0
                                                    for c in costs):
        raise LayoutError(f"parallel.partition_file={path} holds {len(costs)} costs, needs "
                          f"{cfg.model.layers + 2} finite seconds >= 0; delete it to measure "
                          f"again")
    return costs


def known_block_costs(cfg: Config) -> Optional[list[float]]:
    """Before launch: with partition=measured, the costs of an existing ``partition_file``
    (checked against this job; ``plan_job(cfg, block_costs=...)`` takes them), else None
    (``parallel.block_costs`` if set, or the ranks measure)."""
    par = cfg.parallel
    if par.partition != "measured" or par.block_costs is not None:
        return None
    if par.partition_file is not None and Path(par.partition_file).expanduser().exists():
        return read_calibration(par.partition_file, cfg)
    return None
