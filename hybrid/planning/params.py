"""One identity per parameter: its global name, global shape and how it is sharded (pure).

Every parameter of the model has one ``ParamSpec`` (``hybrid.planning.param_spec``), made here
from the model config alone by the model's family (``hybrid.planning.models``: GPT-2's table is
in ``models/gpt2.py``) and attached to the built ``torch`` parameter (``param.spec``) by
``hybrid.model.gpt``. Whatever needs a fact about a parameter reads it from the spec: weight
decay, gradient clipping, the gradient sync's extra reductions, TP gathering, optimizer state,
checkpoints (their tensors are keyed by the specs' global names) and the cost model. Nothing
depends on positional module names (which change with pp, vpp and the partition) or on
substrings of names.
"""

from __future__ import annotations

from hybrid.planning.config import ModelConfig
from hybrid.planning.models import model_spec
from hybrid.planning.param_spec import (EMBEDDING_WEIGHT, TIED_HEAD_ALIAS, ParamSpec,
                                        replicated_spec)

__all__ = ["EMBEDDING_WEIGHT", "TIED_HEAD_ALIAS", "ParamSpec", "block_param_specs",
           "model_param_specs", "replicated_spec"]


def block_param_specs(m: ModelConfig, block_id: int, *,
                      sequence_parallel: bool = False) -> dict[str, ParamSpec]:
    """Block ``block_id``'s parameters: local name (as the block module names it) -> spec.

    Block 0 is the embedding, 1..L the transformer layers, L+1 the head (see
    ``hybrid.model.gpt``). ``sequence_parallel``: whether the model is built with it (tp > 1).
    """
    return model_spec(m).block_params(m, block_id, sequence_parallel)


def model_param_specs(m: ModelConfig, *, sequence_parallel: bool = False
                      ) -> dict[str, ParamSpec]:
    """Every parameter of the model once: global name -> spec, in model order."""
    specs: dict[str, ParamSpec] = {}
    for block_id in range(m.layers + 2):
        for spec in block_param_specs(m, block_id, sequence_parallel=sequence_parallel).values():
            specs.setdefault(spec.name, spec)
    return specs
