"""The one seam between hybrid and megatron-core's layers (``hybrid.megatron_import`` imports
it; ``hybrid.data.megatron`` uses its datasets).

What we take from megatron-core: the tensor-parallel layers' parameter layout and their
layout-independent CPU initialisation (every rank draws the full master weight from the same
RNG stream and keeps its slice), and the ``tensor_model_parallel`` / ``partition_dim``
attributes on sharded parameters.

What we do not take, and why (``tests/test_megatron_adapter.py`` pins each point):

- megatron's layers communicate through ``torch.distributed`` on the torch group they hold;
  hybrid communicates only through its own groups (``hybrid.comm.Group``: counted, timed and
  described when a wait fails). So the layers are built so that megatron issues no collective
  (a column-parallel layer's input-gradient all-reduce is hybrid's ``copy_to_tensor_region``
  in ``_forward_impl``; the row-parallel layer and the embedding do their forward here, with
  ``reduce_from_tensor_region``), and take the torch group only for their sizes and shards.

- ``vocab_parallel_cross_entropy`` reads megatron's global ``parallel_state`` TP group and
  all-reduces three times; ``hybrid.model.cross_entropy`` takes the group and gathers once.
- megatron's sequence-parallel mappings allocate on ``torch.cuda.current_device()`` and its
  linear's ``sequence_parallel=True`` path uses a global CUDA buffer, so they fail on CPU;
  ``hybrid.model.mappings`` has explicit-group, device-neutral versions. Layers here are
  therefore always built with ``config.sequence_parallel=False``; the blocks gather/scatter
  around them.
- megatron's fused linear autograd function (``linear_with_grad_accumulation_and_async_
  allreduce``) is replaced in ``_forward_impl`` by the TP region copy (identity forward,
  all-reduce of the input gradient backward) followed by ``hybrid.model.linear.linear``. Two
  reasons: (1) its single backward node always computes the weight gradient together with the
  input gradient, so a zero-bubble schedule could not defer the weight gradient (ours hands
  it to the W action on request); (2) it is written for CUDA autocast: under CPU autocast its
  backward multiplies a bf16 gradient with the fp32 weight and fails. What we give up is its
  overlap of the input-gradient all-reduce with the weight-gradient matmul.

Megatron's global ``parallel_state`` is never initialised: every layer gets its TP group.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from hybrid.comm import Group
from hybrid.megatron_import import import_megatron
from hybrid.model.linear import linear
from hybrid.model.mappings import (
    copy_to_tensor_region, reduce_from_tensor_region, reduce_scatter_to_sequence_parallel_region,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
]

InitMethod = Callable[[torch.Tensor], None]
ModelParallelConfig = import_megatron().ModelParallelConfig
_mcore_tp = import_megatron("megatron.core.tensor_parallel")


def _layer_config() -> ModelParallelConfig:
    # CPU initialisation is what makes shards slices of one master weight, on any device.
    return ModelParallelConfig(use_cpu_initialization=True, sequence_parallel=False,
                               params_dtype=torch.float32)


def _native_linear(input_: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   allreduce_dgrad: bool, group: Group) -> torch.Tensor:
    """What megatron's fused linear computes, as separate autograd ops (see the module doc).

    ``allreduce_dgrad``: megatron skipped its copy-to-TP-region for this input and expects the
    linear to all-reduce the input gradient; the copy does exactly that in its backward.
    """
    if allreduce_dgrad:
        input_ = copy_to_tensor_region(input_, group)
    return linear(input_, weight, bias)


class ColumnParallelLinear(_mcore_tp.ColumnParallelLinear):
    """megatron's column-parallel linear (output dim sharded) on an explicit TP group.

    ``input_is_gathered=True`` is for sequence parallelism: the caller all-gathered the input
    (whose backward reduce-scatters), so the layer must not also all-reduce the input gradient.
    ``shared_weight=True`` allocates no weight; ``forward`` then takes one (tied embeddings).
    Returns the output tensor only (bias, if any, added). At tp > 1 megatron's forward hands
    the input-gradient all-reduce to ``_forward_impl`` (``allreduce_dgrad``), which is
    hybrid's; at tp = 1 its copy into the region is an identity with no communication.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group: Group,
                 init_method: InitMethod, bias: bool, input_is_gathered: bool = False,
                 shared_weight: bool = False):
        super().__init__(input_size, output_size, config=_layer_config(), init_method=init_method,
                         bias=bias, gather_output=False, skip_weight_param_allocation=shared_weight,
                         disable_grad_reduce=input_is_gathered, tp_group=tp_group.pg)
        self.group = tp_group

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        output, _ = super().forward(input_, weight)
        return output

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 (megatron's name)
        assert not kwargs.get("sequence_parallel"), "layers are built without sequence_parallel"
        return _native_linear(input, weight, kwargs.get("bias"),
                              bool(kwargs.get("allreduce_dgrad")), self.group)


class RowParallelLinear(_mcore_tp.RowParallelLinear):
    """megatron's row-parallel linear (input dim sharded) on an explicit TP group.

    The partial products are all-reduced or, with ``output_sequence_parallel=True``,
    reduce-scattered along the sequence; the bias is added after the reduction, so with
    sequence parallelism it sees only this rank's tokens (its ``ParamSpec`` marks its gradient
    as partial over TP). The forward is hybrid's (megatron's would all-reduce by itself).
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group: Group,
                 init_method: InitMethod, bias: bool, output_sequence_parallel: bool = False):
        super().__init__(input_size, output_size, config=_layer_config(), init_method=init_method,
                         bias=bias, input_is_parallel=True, skip_bias_add=True,
                         tp_group=tp_group.pg)
        self.group = tp_group
        self.output_sequence_parallel = output_sequence_parallel

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        partial = linear(input_, self.weight, None)
        if self.output_sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            output = reduce_from_tensor_region(partial, self.group)
        return output if self.bias is None else output + self.bias


class VocabParallelEmbedding(_mcore_tp.VocabParallelEmbedding):
    """megatron's vocab-parallel embedding (rows sharded, output summed over TP), with
    hybrid's forward: megatron's masking and lookup, then hybrid's reduction."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: Group,
                 init_method: InitMethod):
        super().__init__(num_embeddings, embedding_dim, init_method=init_method,
                         reduce_scatter_embeddings=False, config=_layer_config(),
                         tp_group=tp_group.pg)
        self.group = tp_group

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.group.size() == 1:
            return reduce_from_tensor_region(F.embedding(input_, self.weight), self.group)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local = input_.clone() - self.vocab_start_index
        local[outside] = 0
        output = F.embedding(local, self.weight)
        output[outside, :] = 0.0  # rows held by another rank contribute nothing here
        return reduce_from_tensor_region(output, self.group)

