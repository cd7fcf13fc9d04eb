"""``parallel.pp_balance_move=memory``: a new pipeline split's state moved between the ranks
of each pipeline over point-to-point messages, no disk (issue 55).

Each rank takes what a checkpoint of it would hold (``Checkpointer._state``) as local
tensors by global name: every parameter's local TP/EP shard (whole over DP: ZeRO-3's
shards gathered), its AdamW moments and step (``GradSync.state_dict``, gathered over DP
under ZeRO-1/2/3), the DP option state filed under its name (PowerSGD's error and ``Q``) and
each MoE layer's expert bias. The stages of the new split are built, and
``hybrid.planning.stage_move`` says which names stay and which come from which rank of the
same pipeline: the senders post their old tensors and the receivers the new stages' own
buffers (the parameters themselves, inside ZeRO-3's gathered weights, so the shards take
them) in one batch of messages. Then the moments go to the new optimizer as a resume gives
them, and the DP option state to the new reduction. What a rank holds besides (its RNG, the
DP replicas' shares, the step) does not change with the split and stays as it was.

State filed under no parameter (a delayed DP mean is its bucket's, and the buckets change
with the split) cannot be moved by name: ``hybrid.planning.stage_balance`` refuses
``dp_delay`` with ``pp_balance=dynamic`` before launch (the checkpoint path cannot reshard
it either).
"""

from __future__ import annotations

from typing import Callable

import torch

from hybrid.checkpoint.checkpointer import Checkpointer
from hybrid.comm import RECV, SEND, Message
from hybrid.dp.option_state import (load_option_state, option_state, option_tag,
                                    option_targets)
from hybrid.dp.state import MOMENTS, STATE_KEYS
from hybrid.planning.stage_move import (block_state_names, rank_transfers, stage_state_names,
                                        stage_transfers)

PARAM = "param"
"""The part of a name's state that is the weight itself (or the expert bias)."""
OPTION = "dp_option."
"""Parts that are DP option state: this prefix + the reduction's own key after the name."""

State = dict[str, dict[str, torch.Tensor]]
"""Global name -> part (``PARAM``, ``exp_avg``, ``exp_avg_sq``, ``step``, options) -> tensor."""


def file_options(state: State, options: dict[str, torch.Tensor], tag: str) -> list[str]:
    """Put each of ``options`` (checkpoint key -> tensor) under the name its key names;
    returns the keys that name none."""
    by_length = sorted(state, key=len, reverse=True)  # the longest name that prefixes it
    unfiled = []
    for key, tensor in options.items():
        rest = key[len(tag):] if key.startswith(tag) else key
        owner = next((n for n in by_length if rest.startswith(n + ".")), None)
        if owner is None:
            unfiled.append(key)
        else:
            state[owner][OPTION + rest[len(owner) + 1:]] = tensor
    return unfiled


def held_state(ckpt: Checkpointer) -> tuple[State, list[str]]:
    """This rank's state by name (collective over DP under ZeRO), and the DP option keys
    that belong to no name."""
    sync = ckpt.sync
    gathered = sync.stage_weights(ckpt.chunks) is not None  # ZeRO-3: released after
    with sync.whole_weights(ckpt.chunks):
        state = {spec.name: {PARAM: p.detach().clone() if gathered else p.detach()}
                 for spec, p in ckpt.params}
    for name, moments in sync.state_dict().items():
        device = state[name][PARAM].device  # where the receiver's buffers are
        state[name].update({key: moments[key].to(device) for key in STATE_KEYS})
    state.update({name: {PARAM: bias.detach().clone()} for name, bias in ckpt.biases.items()})
    return state, file_options(state, option_state(sync), option_tag(sync))


def target_state(ckpt: Checkpointer) -> State:
    """What the new stages take the state into: the parameters and biases themselves (call
    inside ``whole_weights(write_back=True)``), fresh moments and step, the reduction's
    option targets."""
    layout = ckpt.groups.layout
    state: State = {}
    for spec, param in ckpt.params:
        shape = spec.local_shape(layout.tp, layout.ep)
        state[spec.name] = {PARAM: param.detach(),
                            "step": torch.zeros((), dtype=torch.float32, device=param.device),
                            **{key: torch.zeros(shape, dtype=torch.float32,
                                                device=param.device) for key in MOMENTS}}
    state.update({name: {PARAM: bias} for name, bias in ckpt.biases.items()})
    unfiled = file_options(state, option_targets(ckpt.sync), option_tag(ckpt.sync))
    assert not unfiled, f"option state {unfiled[:3]} was movable before the re-split"
    return state


def state_names(ckpt: Checkpointer) -> list[frozenset[str]]:
    """Every block's state names in ``ckpt``'s model, by block id."""
    cfg = ckpt.cfg
    blocks = ckpt.plan.stages[-1].blocks.stop
    return [block_state_names(cfg.model, b, sequence_parallel=cfg.parallel.sequence_parallel)
            for b in range(blocks)]


def exchange(groups, transfers: list, held: State, targets: State) -> None:
    """Post every send of ``held``'s and receive into ``targets`` of this rank's
    ``transfers`` in one batch over its pipeline group; wait for all of them. Each pair's
    messages are tagged by their place in the pair's sequence, which both ends count alike
    (the same transfers, parts sorted by name)."""
    offset = groups.replica_offset  # the layout's ranks are this replica of the job's
    rank = groups.local_rank_in_layout
    sends, recvs = rank_transfers(transfers, rank)
    messages, count = [], {}
    for t in sorted(sends + recvs):
        kind, peer, parts = (SEND, t.dst, held[t.name]) if t.src == rank else \
            (RECV, t.src, targets[t.name])
        for part in sorted(parts):
            tag = count[peer] = count.get(peer, -1) + 1
            tensor = parts[part]
            if kind == SEND:
                tensor = tensor.contiguous()
            assert tensor.is_contiguous(), f"{t.name} {part}: a receive needs a whole buffer"
            messages.append(Message(kind, tensor, peer + offset, tag))
    for work in groups.pipeline.exchange(messages) if messages else ():
        work.wait()


def load_moved(ckpt: Checkpointer, kept: State, received: State) -> None:
    """The moments and option state of every name into the new optimizer and reduction
    (``kept``: this rank's old tensors of the names that stayed)."""
    moments, options = {}, {}
    tag = option_tag(ckpt.sync)
    for name, parts in {**received, **kept}.items():
        if "step" in parts:
            moments[name] = {key: parts[key] for key in STATE_KEYS}
        options.update({tag + name + "." + part[len(OPTION):]: t
                        for part, t in parts.items() if part.startswith(OPTION)})
    ckpt.sync.load_state_dict(moments)
    if options:
        load_option_state(ckpt.sync, options)


def move_in_memory(old: Checkpointer, rebuild: Callable[[], Checkpointer]) -> Checkpointer:
    """Every rank: take the state of ``old``'s stages, build the new split's (``rebuild``)
    and move the state into them; returns the new stages' checkpointer."""
    held, unfiled = held_state(old)
    assert not unfiled, f"DP option state {unfiled[:3]} belongs to no parameter: " \
                        f"pp_balance=dynamic should have been refused before launch"
    rng = torch.get_rng_state()  # building the stages must not change what the run draws
    old_ranges = [stage.blocks for stage in old.plan.stages]
    new = rebuild()
    new_ranges = [stage.blocks for stage in new.plan.stages]
    names = state_names(new)
    rank, stage = new.groups.local_rank_in_layout, new.groups.pp_rank
    transfers = stage_transfers(new.groups.layout, names, old_ranges, new_ranges)
    assert set(held) == stage_state_names(names, old_ranges)[stage], \
        f"stage {stage} held other names than its blocks' specs list"
    with new.sync.whole_weights(new.chunks, write_back=True):
        targets = target_state(new)
        kept = {name: held[name] for name in targets if name in held}
        received = {name: parts for name, parts in targets.items() if name not in held}
        assert {t.name for t in transfers if t.dst == rank} == set(received), \
            f"stage {stage} expects other names than the move plan sends it"
        exchange(new.groups, transfers, held, targets)
        for name, parts in kept.items():
            targets[name][PARAM].copy_(parts[PARAM])
    load_moved(new, kept, received)
    torch.set_rng_state(rng)
    return new
