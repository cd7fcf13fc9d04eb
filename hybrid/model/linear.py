"""``linear``: ``F.linear`` as one autograd node whose weight gradient can be deferred.

A zero-bubble pipeline splits a stage's backward into ``I`` (the input gradient, on the
critical path) and ``W`` (the weight gradients, later). With plain autograd ops, ``W`` can only
get a matmul's weight gradient by running that matmul's node again from its saved gradient:
one engine call per matmul, each walking the graph below it, which on a small model costs as
much again as the matmuls themselves. This node instead offers the split itself
(``hybrid.pipeline.backward`` is its caller):

- before a backward, the caller sets ``grad_fn.defer_weight_grad = True``;
- the backward then returns the input gradient only and keeps the gradient that reached it
  and its input (not the graph: the caller may free that);
- ``grad_fn.deferred_weight_grads(grad_fn)`` later returns the gradients of
  ``(input, weight, bias)`` (input's None), computed then and in the parameters' own dtypes,
  for the caller to accumulate in one engine call. (A plain function stored on the node, not
  a bound method or closure, which would make a reference cycle that keeps the node, and
  what it saved, alive until the garbage collector runs.)

Without the flag the backward is the ordinary one. Under autocast the node casts its operands
as autocast would cast ``F.linear``'s, and computes in that dtype both ways; the engine (or the
caller) casts the gradients to each input's dtype, as autograd's own cast nodes would.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def linear(input_: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
           ) -> torch.Tensor:
    """``F.linear(input_, weight, bias)`` whose backward node can defer its weight gradient."""
    return _SplitBackwardLinear.apply(input_, weight, bias)


def _autocast_dtype(tensor: torch.Tensor) -> Optional[torch.dtype]:
    device = tensor.device.type
    if tensor.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


class _SplitBackwardLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, weight, bias):
        dtype = _autocast_dtype(input_)
        ctx.param_dtypes = (weight.dtype, None if bias is None else bias.dtype)
        if dtype is not None:
            input_, weight = input_.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        with torch.autocast(input_.device.type, enabled=False):
            output = F.linear(input_, weight, bias)
        ctx.save_for_backward(input_, weight)
        ctx.has_bias = bias is not None
        ctx.defer_weight_grad, ctx.pending = False, None
        ctx.deferred_weight_grads = _weight_grads
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        grad_output = grad_output.to(weight.dtype)
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.defer_weight_grad:
            ctx.pending = (grad_output, input_)
            return grad_input, None, None
        return (grad_input,) + _param_grads(ctx, grad_output, input_)


def _param_grads(ctx, grad_output: torch.Tensor, input_: torch.Tensor) -> tuple:
    """Gradients of (weight, bias): ``[out, in]`` and ``[out]`` from ``[..., out]``/``[..., in]``."""
    flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
    grad_weight = grad_bias = None
    if ctx.needs_input_grad[1]:
        grad_weight = flat_grad.t().mm(input_.reshape(-1, input_.shape[-1]))
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = flat_grad.sum(0)
    return grad_weight, grad_bias


def _weight_grads(ctx) -> tuple:
    """The deferred ``(None, weight grad, bias grad)`` in the parameters' dtypes;
    ``(None, None, None)`` when no deferred backward reached the node. Clears what it kept."""
    pending, ctx.pending, ctx.defer_weight_grad = ctx.pending, None, False
    if pending is None:
        return None, None, None
    grads = _param_grads(ctx, *pending)
    return (None,) + tuple(None if g is None else g.to(dtype)
                           for g, dtype in zip(grads, ctx.param_dtypes))
