"""The pieces of loading a checkpoint into one rank: the tensors DCP loads into (the
parameters themselves and fresh AdamW moments), DCP's read with an unreadable file in one
line, and the check that no saved tensor was left behind.

Apart from ``checkpointer.py``, which decides what to load (resume, ``init_from``) and puts
the loaded state into the DP strategies, the RNG and the replicas' shares.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hybrid.checkpoint.dcp_io import SafeReader, as_global, os_error_in, read_metadata
from hybrid.checkpoint.store import CheckpointError
from hybrid.dp.option_state import PREFIX as OPTION_PREFIX
from hybrid.dp.state import MOMENTS
from hybrid.planning.balance import CHECKPOINT_KEY as SHARES_KEY


def load_targets(params: list, layout, mesh) -> tuple[dict, dict]:
    """Tensors for DCP to load into: the parameters themselves, fresh moment buffers."""
    tp, ep = layout.tp, layout.ep
    targets = {f"model.{spec.name}": as_global(param.detach(), spec, mesh)
               for spec, param in params}
    moments: dict[str, dict] = {}
    for spec, param in params:
        entry = moments[spec.name] = {"step": torch.zeros((), dtype=torch.float32)}
        targets[f"optim.{spec.name}.step"] = entry["step"]
        for key in MOMENTS:
            entry[key] = torch.zeros(spec.local_shape(tp, ep), dtype=torch.float32,
                                     device=param.device)
            targets[f"optim.{spec.name}.{key}"] = as_global(entry[key], spec, mesh)
    targets["train.step"] = torch.zeros((), dtype=torch.int64)
    targets["rng.cpu"] = torch.get_rng_state()
    return targets, moments


def check_every_key_loaded(path: Path, targets: dict, world) -> None:
    """A key of the checkpoint that no rank asked for would be silently dropped."""
    asked = world.all_gather_objects(sorted(targets))
    saved = set(read_metadata(path).state_dict_metadata)
    # DP option state is left out on purpose where the layout changed (dp.option_state)
    # ... and so are the DP shares of a dynamic run (hybrid.balance.replicas)
    unused = sorted(key for key in saved - set().union(*map(set, asked))
                    if not key.startswith(OPTION_PREFIX) and key != SHARES_KEY)
    if unused:
        raise CheckpointError(f"checkpoint {path} holds {len(unused)} tensors this model "
                              f"has no place for (first: {unused[0]}); check the model "
                              f"config against hybrid-ckpt show {path}")


def read_checkpoint(path: Path, targets: dict) -> None:
    """DCP's load of ``targets`` from checkpoint ``path``; an unreadable file in one line."""
    try:
        dcp.load(targets, storage_reader=SafeReader(path))
    except CheckpointException as err:
        cause = os_error_in(err)
        if cause is None:
            raise
        raise CheckpointError(f"checkpoint {path} cannot be read ({cause}); resume from "
                              f"an older one") from None
