"""The bytes each rank really holds, beside the cost model's prediction: ``memory_check.json``.

After its first step every rank counts the distinct storages of its parameters, of its
gradient buffers (the buckets, and under ZeRO the reduced shards), of its optimizer
state and of what a DP option keeps (PowerSGD's error feedback, a delayed mean), and measures
the activations its step kept for backward at their peak
(``hybrid.model.activations.SavedTensors``) and, under ZeRO-3, the most whole weights it held
gathered at once. Rank 0 writes them with the plan's prediction for the same rank: weights,
gradients, optimizer state and gathered weights must be equal byte for byte (the
end-to-end tests assert it for every layout they run); activations are a model and the file
shows how close (``bench/cost_vs_measured.py`` reports the error over many layouts).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterable

import torch

from hybrid.model.activations import SavedTensors
from hybrid.planning.job import JobPlan
from hybrid.planning.rank_memory import rank_state_bytes
from hybrid.files import write_text

FILE = "memory_check.json"


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def counted_state_bytes(chunks: Iterable[torch.nn.Module], sync) -> list[int]:
    """[parameter, gradient, optimizer state, DP option state] bytes this rank holds."""
    params = sync.held_weights([p for chunk in chunks for p in chunk.parameters()])
    state = [t for per_tensor in sync.optimizer.state.values() for t in per_tensor.values()
             if isinstance(t, torch.Tensor)]
    return [_storage_bytes(params), _storage_bytes(sync.grad_tensors()), _storage_bytes(state),
            _storage_bytes(sync.dp_state_tensors())]


def write_memory_check(run_dir: Path, plan: JobPlan, per_rank: list[list[float]]) -> None:
    """Rank 0: ``memory_check.json`` from every rank's ``[param, grad, optimizer, DP option
    state, activation peak, ZeRO-3's gathered peak]``, with whether the state bytes, and the
    gathered weights, all equal the prediction."""
    cfg = plan.cfg
    ranks, equal, gathered_equal = [], True, True
    for rank, (param, grad, optimizer, dp_state, activations, gathered) in enumerate(per_rank):
        coords = plan.layout.coords(rank % plan.world_size)
        blocks = [b for s in plan.stages_of(coords["pp"]) for b in s.blocks]
        shard = plan.layout.role_rank("sharding", rank % plan.world_size)
        experts = plan.layout.role_rank("expert_sharding", rank % plan.world_size)
        predicted = rank_state_bytes(cfg, plan.layout, blocks, dp_rank=shard,
                                     expert_rank=experts).to_dict()
        counted = {"param_bytes": int(param), "grad_bytes": int(grad),
                   "optimizer_bytes": int(optimizer), "dp_state_bytes": int(dp_state)}
        equal &= counted == predicted
        predicted_gathered = plan.memory[coords["pp"]].gathered_bytes
        gathered_equal &= int(gathered) == predicted_gathered
        ranks.append({"rank": rank, **coords, "counted": counted, "predicted": predicted,
                      "activation_peak_bytes": int(activations),
                      "predicted_activation_bytes":
                          plan.memory[coords["pp"]].activation_bytes,
                      "gathered_peak_bytes": int(gathered),
                      "predicted_gathered_bytes": predicted_gathered})
    write_text(run_dir / FILE, json.dumps({"state_bytes_equal": equal,
                                           "gathered_bytes_equal": gathered_equal,
                                           "ranks": ranks}, indent=1) + "\n")


def saved_tensors(chunks: Iterable[torch.nn.Module], on: bool):
    """Around the first updating step: counts what autograd keeps for backward (not the
    parameters themselves); a no-op context on the other steps."""
    if not on:
        return contextlib.nullcontext()
    return SavedTensors(p for chunk in chunks for p in chunk.parameters())


def check_memory(run_dir: Path, plan: JobPlan, chunks: Iterable[torch.nn.Module], sync,
                 saved: SavedTensors, gathered_peak: int,
                 gather: Callable[[list[float]], list[list[float]]]) -> None:
    """Every rank's counted bytes, gathered over the job (``gather``); rank 0 writes them
    beside the prediction."""
    per_rank = gather([*counted_state_bytes(chunks, sync), saved.peak, gathered_peak])
    if torch.distributed.get_rank() == 0:
        write_memory_check(run_dir, plan, per_rank)
