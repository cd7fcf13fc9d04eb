"""Model blocks on megatron-core tensor-parallel layers, with layout-independent initialisation:
GPT-2's (``blocks.py``) and any family's, found by ``model.family`` (``families.py``).

Only ``hybrid.model.megatron_adapter`` imports megatron-core. Names are loaded on first use
(PEP 562): importing the package costs nothing until a name is used. Parameter counts and
shape rules are pure Python and live outside it (``hybrid.planning.cost.sizes``,
``hybrid.planning.validate``).
"""

import importlib

_EXPORTS = {
    "hybrid.model.gpt": ["GPT", "build_blocks", "num_blocks", "block_seed", "block_generator",
                         "lm_loss"],
    "hybrid.model.blocks": ["EmbeddingBlock", "TransformerLayer", "HeadBlock"],
    "hybrid.model.families": ["FamilyBlocks", "register_blocks", "family_blocks"],
    "hybrid.model.cross_entropy": ["vocab_parallel_cross_entropy"],
    "hybrid.model.inputs": ["ModelInputError", "validate_batch", "validate_batch_across"],
    "hybrid.model.shards": ["gather_tp_param", "load_global_weights"],
    "hybrid.model.mappings": [
        "allreduce_sequence_parallel_grads", "sequence_parallel_params",
        "copy_to_tensor_region", "reduce_from_tensor_region",
        "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
        "scatter_to_sequence_parallel_region"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'hybrid.model' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
