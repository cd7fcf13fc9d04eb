"""Optimizer state addressed per global parameter, whatever the ZeRO stage and bucket layout.

``optimizer_state(sync)`` returns, for every parameter this rank holds, its global name ->
``{"exp_avg", "exp_avg_sq"}`` shaped like the parameter's TP shard, plus ``"step"`` (AdamW's
0-d step count). Without ZeRO that is AdamW's own state. Under ZeRO-1 each DP rank holds only
its shard's slices of every bucket: the flat moments are all-gathered over DP per bucket (as
Megatron's distributed optimizer gathers its state to save it) and cut back into parameters, so
the result is the same tensors whatever ``parallel.zero`` and ``parallel.bucket_mb`` were.

``load_optimizer_state(sync, states)`` is the inverse: each piece the optimizer steps (a whole
parameter, or under ZeRO-1 the slice of one in this rank's shard) gets its slice of the moments.
A missing name or a wrong shape raises: nothing is left at its initial value.
"""

from __future__ import annotations

import torch

from hybrid.optim import step_count
from hybrid.errors import UserError

MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_KEYS = MOMENTS + ("step",)


class OptimizerStateError(UserError):
    """The optimizer state to load does not cover what this rank steps."""


def optimizer_state(sync) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's parameters' AdamW state by global name (collective over DP under ZeRO-1)."""
    step = _common_step(sync)
    if not sync.sharding.shards_state:
        out = {}
        for piece in sync.pieces:
            state = sync.optimizer.state[piece.tensor]
            out[sync.specs[id(piece.param)].name] = {key: state[key] for key in STATE_KEYS}
        return out
    out: dict[str, dict[str, torch.Tensor]] = {}
    for shard in sync.shards:
        bucket = shard.bucket
        for key in MOMENTS:
            full = _gathered_moment(sync, shard, key)
            for slot, param in enumerate(bucket.params):
                begin, end = bucket.span(slot)
                name = sync.specs[id(param)].name
                out.setdefault(name, {"step": step.clone()})[key] = full[begin:end].view_as(param)
    return out


def _common_step(sync) -> torch.Tensor:
    """AdamW's step count, the same for every tensor it steps (every one steps every time)."""
    states = [sync.optimizer.state.get(piece.tensor) for piece in sync.pieces]
    steps = {float(state["step"]) for state in states if state}
    if len(steps) != 1 or not all(states):
        raise OptimizerStateError(f"optimizer state is incomplete or uneven (step counts "
                                  f"{sorted(steps)}); save only after an optimizer step")
    return states[0]["step"].clone()


def _gathered_moment(sync, shard, key: str) -> torch.Tensor:
    """One moment of a whole ZeRO bucket as a flat tensor: every DP rank's shard gathered."""
    bucket = shard.bucket
    local = torch.zeros(shard.end - shard.start, dtype=torch.float32, device=bucket.grad.device)
    slots = {id(param): slot for slot, param in enumerate(bucket.params)}
    for piece in sync.pieces_by_bucket[bucket.index]:
        # a piece's place in the shard: its parameter's in the bucket, plus its offset
        start = bucket.span(slots[id(piece.param)])[0] + piece.offset - shard.start
        local[start:start + piece.tensor.numel()] = sync.optimizer.state[piece.tensor][key]
    group = bucket.shard_group
    if group.size() == 1:
        return local
    full = torch.empty(bucket.numel, dtype=torch.float32, device=local.device)
    group.all_gather_into(full, local)
    return full


def load_optimizer_state(sync, states: dict[str, dict[str, torch.Tensor]]) -> None:
    """Set AdamW's state of every piece this rank steps from ``states`` (as returned by
    ``optimizer_state``, e.g. loaded from a checkpoint on another layout). Every parameter
    this rank holds must be there, even one whose elements lie in other ranks' ZeRO shards."""
    for spec in sync.specs.values():
        saved = states.get(spec.name)
        if saved is None or any(key not in saved for key in STATE_KEYS):
            raise OptimizerStateError(f"no complete optimizer state for {spec.name}")
    for piece in sync.pieces:
        name = sync.specs[id(piece.param)].name
        saved = states[name]
        numel = piece.tensor.numel()
        state = {"step": step_count(saved["step"], piece.tensor, sync.optimizer)}
        for key in MOMENTS:
            moment = saved[key]
            if tuple(moment.shape) != tuple(piece.param.shape):
                raise OptimizerStateError(f"optimizer {key} of {name} has shape "
                                          f"{tuple(moment.shape)}, the parameter "
                                          f"{tuple(piece.param.shape)}")
            flat = moment.detach().reshape(-1)[piece.offset:piece.offset + numel]
            state[key] = flat.view_as(piece.tensor).to(piece.tensor.device).clone()
        sync.optimizer.state[piece.tensor] = state
