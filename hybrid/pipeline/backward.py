"""Backward passes of one pipeline stage: full (``B``), input-only (``I``) and weight-only (``W``).

``I`` must produce the stage's input gradient without the weight gradients, and ``W`` must
later produce the weight gradients without redoing the work of ``I``. Autograd computes only
the outputs that lead to the requested inputs, so ``I`` asks for the input gradient and, on the
way, keeps what ``W`` needs at every *branch node*: a node on the path from the stage output to
the stage input that also leads to parameters. ``W`` restarts the backward there
(``GradientEdge`` roots), so only the parameter side of each branch runs. This is the idea of
torch.distributed.pipelining's ``stage_backward_input``/``stage_backward_weight``, on public
autograd APIs; unlike that code, ``W`` accumulates through each parameter's own
``AccumulateGrad`` node, so post-accumulate-grad hooks (the data-parallel sync counts them)
fire once per parameter and micro-batch.

What ``I`` keeps for a branch node depends on its kind:

- a node that splits itself (it has ``deferred_weight_grads``, as ``hybrid.model.linear``'s
  has; every linear of the GPT model): ``I`` sets its ``defer_weight_grad`` flag, so that its
  backward computes the input gradient only and keeps its gradient and input; ``W`` asks it
  for the weight gradients and seeds them straight into the parameters. No engine call runs
  it twice and none walks the graph for it, so ``I`` + ``W`` cost what ``B`` costs;
- another matrix product (``mm``/``linear``/``conv`` in its name), whose weight gradient is
  the work worth deferring: the gradient that reached it, so that ``W`` runs it again for its
  weight side only (one engine call per node, each walking the graph below it); but if it is
  a custom ``autograd.Function`` that computed its weight gradient in ``I`` anyway (megatron's
  fused linear), ``W`` starts from that result instead of running it twice (which would also
  repeat its TP all-reduce of the input gradient);
- anything else (layer norm, a bias add): its parameter gradients are cheap, so ``I`` asks
  autograd for them along with the input gradient. Running such a node again in ``W`` would
  cost one autograd call per node, each walking the graph, which is far more than the work.

When no node is run again, ``W`` needs nothing of the graph but the parameters' accumulators,
so ``I`` frees it (``retain_graph=False``): between ``I`` and ``W`` a stage holds only what
the weight gradients need (each linear's input and output gradient), not every activation.
Seeds that land on parameters' accumulators (every linear's, every layer norm's) are summed per
parameter and handed to its ``AccumulateGrad`` node directly: the node accumulates in place and
runs the post-accumulate-grad hooks, as under the engine, and an engine call per micro-batch
(5-10x the cost of calling the nodes) is saved. If any seed of a micro-batch cannot go that way
(a parameter with ``Tensor.register_hook`` hooks, which only the engine runs; a seed not of its
parameter's shape, dtype and device), all of that micro-batch's seeds go through the engine in
one call, as do nodes run again. Hooks on an ``AccumulateGrad`` node itself
(``Node.register_hook``) run only under the engine; hybrid registers none.

Parameters reached from several roots (a weight used twice) get all their roots in one call,
so that each accumulates exactly once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

Root = Union[torch.Tensor, GradientEdge]  # a stage output (or loss) to differentiate
EdgeKey = tuple[Node, int]  # a GradientEdge as a dict key

_DEFERRED_NODE = re.compile(r"mm|linear|conv", re.IGNORECASE)


def full_backward(root: Root, grad: Optional[torch.Tensor]) -> None:
    """``B``: every gradient at once, accumulated into ``.grad`` of the leaves it reaches."""
    torch.autograd.backward([root], grad_tensors=None if grad is None else [grad])


@dataclass(eq=False)
class _Branch:
    node: Node
    param_edges: list[EdgeKey]  # the node's next edges that lead to parameters only
    accumulators: set  # AccumulateGrad nodes below those edges
    grad_outputs: Optional[tuple] = None  # what reached the node during I
    param_grads: Optional[list] = None  # what it produced for param_edges during I, if anything

    @property
    def splits_itself(self) -> bool:
        return hasattr(self.node, "deferred_weight_grads")

    @property
    def deferred(self) -> bool:
        """Run again in W (a matrix product that does not split itself)."""
        return not self.splits_itself and bool(_DEFERRED_NODE.search(self.node.name()))


@dataclass(eq=False)
class _Start:
    """One group of ``W`` roots: seeds on parameter-only edges, or a node to run again."""

    roots: list[GradientEdge]
    grads: list[torch.Tensor]
    accumulators: set
    pinned: list = field(default_factory=list)  # (node, saved grad_outputs) run again


@dataclass
class WeightGradients:
    """What ``I`` leaves for ``W``."""

    starts: list[_Start] = field(default_factory=list)
    self_split: list[_Branch] = field(default_factory=list)  # asked for their gradients in W

    def run(self) -> None:
        """``W``: accumulate this micro-batch's weight gradients into ``.grad``; frees the graph."""
        with torch.no_grad():  # the seeds are values: recording their matmuls would keep the
            # linears' inputs' graph alive until W ends, and cost autograd's bookkeeping
            self_split = [_self_split_start(branch) for branch in self.self_split]
        starts = self.starts + self_split
        self.starts, self.self_split = [], []
        # Seeds below branch nodes never reach the input path: one call takes them all (a
        # parameter seeded twice accumulates once). Only a re-run node's call must also take
        # the seeds that share its parameters.
        groups = _merge_sharing(starts) if any(s.pinned for s in starts) else starts
        seeds = [g for g in groups if not g.pinned]
        _accumulate(_concat(seeds))
        for group in (g for g in groups if g.pinned):
            # Pin each re-run node to its saved gradient: when one lies below another, the
            # gradient reaching it in this call would otherwise be added to the saved one.
            handles = [node.register_prehook(lambda _, saved=saved: saved)
                       for node, saved in group.pinned]
            try:
                _accumulate(group)
            finally:
                for handle in handles:
                    handle.remove()


def _accumulate(start: _Start) -> None:
    if not start.roots:
        return
    seeds = None if start.pinned else _seeds_by_accumulator(start)
    if seeds is None:
        params = [accumulator.variable for accumulator in start.accumulators]
        torch.autograd.backward(start.roots, grad_tensors=start.grads, inputs=params)
        return
    # Every root is a parameter's own AccumulateGrad node: run each once, as the engine would
    # (in place under no_grad, then its post-accumulate-grad hooks), without an engine call,
    # which costs 5-10x calling the nodes (torch's Python checks of each root, the graph task).
    # Hooks registered on the node itself (Node.register_hook/prehook) would not run: hybrid
    # registers none, and torch offers no way to see them.
    with torch.no_grad():
        for accumulator, grad in seeds.items():
            accumulator(grad)


def _seeds_by_accumulator(start: _Start) -> Optional[dict]:
    """``start``'s seeds summed per AccumulateGrad node, or None (the engine takes them all)
    when some root is another node, a parameter has ``Tensor.register_hook`` hooks (which only
    the engine runs), or a seed is not of its parameter's shape, dtype and device (which the
    engine would check, and cast)."""
    seeds: dict = {}
    for root, grad in zip(start.roots, start.grads):
        node = root.node
        if not _is_accumulator(node) or not _fits(grad, node.variable):
            return None
        seeds[node] = grad if node not in seeds else seeds[node] + grad
    return seeds


def _fits(grad: torch.Tensor, param: torch.Tensor) -> bool:
    return (grad.shape == param.shape and grad.dtype == param.dtype
            and grad.device == param.device and not getattr(param, "_backward_hooks", None))


def _concat(starts: list[_Start]) -> _Start:
    merged = _Start([], [], set())
    for start in starts:
        merged.roots += start.roots
        merged.grads += start.grads
        merged.accumulators |= start.accumulators
        merged.pinned += start.pinned
    return merged


def _merge_sharing(starts: list[_Start]) -> list[_Start]:
    """Merge starts that reach a common parameter: each parameter accumulates in one call."""
    groups: list[_Start] = []
    for start in starts:
        sharing = [g for g in groups if g.accumulators & start.accumulators]
        groups = [g for g in groups if not g.accumulators & start.accumulators]
        groups.append(_concat(sharing + [start]))
    return groups


def input_backward(root: Root, grad: Optional[torch.Tensor], stage_input: torch.Tensor
                   ) -> tuple[torch.Tensor, WeightGradients]:
    """``I``: the gradient of ``stage_input`` (a leaf) only; returns it and the work for ``W``.

    The graph is kept (``retain_graph``) until ``W`` only if ``W`` runs some of its nodes.
    """
    top = root.node if isinstance(root, GradientEdge) else root.grad_fn
    branches = find_branches(top, get_gradient_edge(stage_input).node)
    deferred = [b for b in branches if b.deferred]
    self_split = [b for b in branches if b.splits_itself]
    eager_edges = list(dict.fromkeys(e for b in branches
                                     if not b.deferred and not b.splits_itself
                                     for e in b.param_edges))
    seeded = eager_edges + [e for b in self_split for e in b.param_edges]
    retain = bool(deferred) or not all(_is_accumulator(node) for node, _ in seeded)
    for branch in self_split:
        branch.node.defer_weight_grad = True
    handles = []
    for branch in deferred:
        handles.append(branch.node.register_prehook(_keep_grad_outputs(branch)))
        handles.append(branch.node.register_hook(_keep_param_grads(branch)))
    try:
        input_grad, *eager_grads = torch.autograd.grad(
            [root], [stage_input] + [GradientEdge(*edge) for edge in eager_edges],
            grad_outputs=None if grad is None else [grad], retain_graph=retain,
            allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    below = _accumulators_below
    starts = [_Start([GradientEdge(*edge)], [g], below([edge[0]]))
              for edge, g in zip(eager_edges, eager_grads) if g is not None]
    starts += [_deferred_start(branch) for branch in deferred]
    return input_grad, WeightGradients([s for s in starts if s.roots], self_split)


def _is_accumulator(node: Node) -> bool:
    return hasattr(node, "variable")  # AccumulateGrad: the node of a leaf


def _self_split_start(branch: _Branch) -> _Start:
    """Seeds of the weight gradients a self-splitting node kept from ``I``."""
    node = branch.node
    grads = node.deferred_weight_grads(node)
    pairs = [(GradientEdge(*edge), grads[index])
             for index, edge in enumerate(node.next_functions)
             if edge in branch.param_edges and grads[index] is not None]
    return _Start([r for r, _ in pairs], [g for _, g in pairs], branch.accumulators)


def _deferred_start(branch: _Branch) -> _Start:
    if branch.param_grads is not None:  # computed in I anyway: seed below the node
        pairs = [(GradientEdge(*e), g) for e, g in zip(branch.param_edges, branch.param_grads)]
        return _Start([r for r, _ in pairs], [g for _, g in pairs], branch.accumulators)
    grads = branch.grad_outputs or ()
    roots = [GradientEdge(branch.node, nr) for nr, g in enumerate(grads) if g is not None]
    return _Start(roots, [g for g in grads if g is not None], branch.accumulators,
                  [(branch.node, branch.grad_outputs)])


def _keep_grad_outputs(branch: _Branch):
    def hook(grad_outputs):
        branch.grad_outputs = grad_outputs
    return hook


def _keep_param_grads(branch: _Branch):
    indices = [i for i, edge in enumerate(branch.node.next_functions)
               if edge in branch.param_edges]

    def hook(grad_inputs, _grad_outputs):
        produced = [grad_inputs[i] for i in indices]
        if all(g is not None for g in produced):  # built-in nodes skip unrequested outputs
            branch.param_grads = produced
    return hook


def find_branches(top: Node, input_node: Node) -> list[_Branch]:
    """The nodes from which both ``input_node`` and some parameter are reachable, each with
    the edges that lead to parameters only (one depth-first pass over the graph)."""
    nexts: dict[Node, tuple] = {}
    reaches_input: dict[Node, bool] = {input_node: True}
    stack = [(top, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            reaches_input[node] = any(reaches_input[n] for n, _ in nexts[node] if n is not None)
            continue
        if node in reaches_input or node in nexts:
            continue
        nexts[node] = node.next_functions
        stack.append((node, True))
        stack.extend((n, False) for n, _ in nexts[node]
                     if n is not None and n not in reaches_input)
    branches = []
    for node, edges in nexts.items():
        if not reaches_input[node]:
            continue
        param_edges = [edge for edge in edges
                       if edge[0] is not None and not reaches_input[edge[0]]]
        if param_edges:
            below = _accumulators_below([n for n, _ in param_edges])
            branches.append(_Branch(node, param_edges, below))
    return branches


def _accumulators_below(starts: list[Node]) -> set:
    """The AccumulateGrad nodes (one per leaf, i.e. parameter) reachable from ``starts``."""
    found, stack, seen = set(), list(starts), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _is_accumulator(node):
            found.add(node)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return found
