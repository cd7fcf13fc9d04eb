"""``GradSync``: the one object the training loop talks to about gradients and the optimizer.

Per optimizer step the loop makes exactly two calls around its micro-batches::

    sync.start_step(num_microbatches)
    for each micro-batch (in any pipeline schedule): backward of loss / num_microbatches
    grad_norm = sync.finish_step(lr=lr_at(step, cfg.optim, cfg.train.steps),
                                 max_norm=cfg.train.grad_clip)

When is a gradient final? Counted, not flagged: a hook after each gradient accumulation counts
per parameter; when a parameter has accumulated ``num_microbatches`` times, its gradient is
final, and when every parameter of a bucket is final, that bucket's DP collective starts
asynchronously, while the backward of the last micro-batch goes on. Buckets start strictly in
order (all ranks must issue collectives in the same order, as DDP does). Nothing else toggles
sync: this works the same under any pipeline schedule and with activation recomputation.

Averaging: pre-divide. A bucket is scaled by ``1/d`` (``d`` = DP size) and then summed over DP,
so every rank ends with the mean of the DP ranks' gradients; with the loss of each micro-batch
scaled by ``1/num_microbatches`` that is the 1-process mean gradient over the global batch.
For power-of-two ``d`` the division is exact, so pre- and post-dividing agree bit for bit.
That takes a rank's gradient as its replica's; an expert's sums the losses of its expert group
(``Placement.loss_role``) and is divided by their count as it arrives (``_replica_gradient_hooks``).

Gradients are reduced in fp32 (the buffers are fp32; parameters stay fp32 master weights and
bf16 compute runs under autocast, whose gradients arrive in the parameters' fp32).

The DP strategies plug in here, each the runtime of a spec in ``hybrid.planning.strategies``
(which says what it sends and keeps): the sharding (``parallel.zero``: ``dp.sharding``, with
ZeRO's shards in ``dp.zero`` and ZeRO-2's per-micro-batch staging in ``dp.zero2``) and the
reduction (exact or bf16 in ``dp.reduce``, ``dp.powersgd``, local SGD or one-step-delayed
gradients in ``dp.replicas``). This class asks them; it names none of them.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from hybrid.dp.buckets import Bucket, Piece, build_buckets
from hybrid.dp.clip import clip_coefficient, counts_in_norm, global_grad_norm, scale_grads_
from hybrid.dp.state import load_optimizer_state, optimizer_state
from hybrid.errors import UserError
from hybrid.optim import build_adamw, set_lr, unique_parameters
from hybrid.planning.config import OptimConfig
from hybrid.planning.params import ParamSpec
from hybrid.planning.strategies import DpOptions, option_problem, reduction_of, sharding_of

MIB = 1024 * 1024


class DataParallelConfigError(UserError):
    """A user error in the DP/ZeRO settings; one line, with the fix."""


def _plain_wait(work: dist.Work) -> None:
    work.wait()


def runtime_class(spec) -> type:
    """A strategy spec's runtime class: ``spec.runtime`` itself, or the class its
    ``"module:Class"`` name names (imported here, so planning never imports the runtime)."""
    target = spec.runtime
    if isinstance(target, str):
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)
    return target


class GradSync:
    """Bucketed DP gradient sync, other-axis reductions, clipping, AdamW and the DP strategies.

    ``model``: this rank's module, or its list of model chunks (pipeline stages). All its
    trainable parameters must be fp32. ``bucket_mb``: bucket size in MiB. ``zero``: the ZeRO
    stage. ``options``: the other DP settings (``hybrid.planning.strategies.DpOptions``;
    default exact). ``optimizer`` is the AdamW it builds (over shard slices under ZeRO).
    """

    def __init__(self, model: Union[nn.Module, Iterable[nn.Module]], groups,
                 optim: OptimConfig, *, bucket_mb: float = 25.0, zero: int = 0,
                 options: Optional[DpOptions] = None,
                 wait: Optional[Callable[[dist.Work], None]] = None):
        """``wait(work)`` waits for each asynchronous DP collective (default ``work.wait()``;
        the trainer's ``RankWatch.wait_async`` times it and says what it was)."""
        options = DpOptions(zero=zero) if options is None else replace(options, zero=zero)
        _check_settings(options, groups.layout.role_size("gradient"), bucket_mb)
        modules = [model] if isinstance(model, nn.Module) else list(model)
        named = unique_parameters(modules)
        _check_fp32(named)
        self.groups, self.options = groups, options
        self.wait = wait or _plain_wait
        self.specs = {id(p): spec for spec, p in named}
        """Every parameter's spec, by ``id``: a plain module's gets one named by its place."""
        self.uses = {id(p): sum(any(p is q for q in m.parameters()) for m in modules)
                     for _, p in named}
        """Chunks using each parameter: a tied embedding used by two chunks of one rank (the
        V placement's rank 0) accumulates once per chunk's backward, so twice a micro-batch."""
        self.sharding = runtime_class(sharding_of(options))(self.wait)
        self.buckets, self.num_overlapped = build_buckets(
            [p for _, p in named], groups, bucket_bytes=int(bucket_mb * MIB),
            pads=self.sharding.pads,
            grad_buffer=self.sharding.keeps_grad_buffer, flatten=self.sharding.flattens)
        self.shards = self.sharding.make_shards(self.buckets)
        self.pieces_by_bucket = self.sharding.pieces(
            self.buckets, self._decays, partial(counts_in_norm, groups=groups))
        """What the optimizer steps, per bucket: parameters, or their slices in this shard."""
        self.pieces = [piece for pieces in self.pieces_by_bucket for piece in pieces]
        self.optimizer = build_adamw([(p.tensor, p.decays) for p in self.pieces], optim)
        self._norm_grads = self._grads_counted_in_norm(self.pieces_by_bucket)
        self.reducer = runtime_class(reduction_of(options))(self.buckets, options, self.wait)
        self._hooks = [param.register_post_accumulate_grad_hook(partial(self._accumulated, b, i))
                       for b in self.buckets for i, param in enumerate(b.params)]
        self._hooks += _replica_gradient_hooks(named, groups)
        self._microbatches: Union[int, None] = None
        self._next_launch = 0
        self.step = 0
        """The optimizer step being taken (1-based; ``start_step`` sets it)."""
        self.launched_in_backward = 0
        """Overlapped buckets whose collective started during the last step's backward."""

    @classmethod
    def from_config(cls, model: Union[nn.Module, Iterable[nn.Module]], groups,
                    cfg, wait: Optional[Callable[[dist.Work], None]] = None) -> "GradSync":
        """From a ``hybrid.planning.config.Config``: ``optim`` and ``parallel``'s DP options."""
        return cls(model, groups, cfg.optim, bucket_mb=cfg.parallel.bucket_mb,
                   zero=cfg.parallel.zero, options=DpOptions.of(cfg.parallel), wait=wait)

    # ----- construction ----------------------------------------------------------------------
    def _decays(self, param: torch.Tensor) -> bool:
        return self.specs[id(param)].weight_decay

    def _grads_counted_in_norm(self, pieces_by_bucket: list[list[Piece]]) -> dict:
        """By placement (one per bucket): a bucket's whole buffer where all its pieces count
        (one dot product per bucket; the padding is zero), else its counted pieces one by
        one."""
        grads: dict = {}
        for bucket, buffer, pieces in zip(self.buckets, self.sharding.grad_buffers(self.buckets),
                                          pieces_by_bucket):
            mine = grads.setdefault(self.specs[id(bucket.params[0])].placement, [])
            if all(p.counts_in_norm for p in pieces):
                mine.append(buffer)
            else:
                mine.extend(p.grad for p in pieces if p.counts_in_norm)
        return grads

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every gradient buffer this rank keeps between steps."""
        return [b.grad for b in self.buckets if b.grad.numel()] + \
            [s.grad for s in self.shards if s.grad.numel()]

    def held_weights(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The weight tensors this rank holds: ``params`` (the model's), and ZeRO-3's shards."""
        return list(params) + self.sharding.held_weights()

    def stage_weights(self, chunks: dict[int, nn.Module]):
        """ZeRO-3: the object that runs the schedule's gathers and releases of the stages in
        ``chunks`` (``hybrid.dp.zero3.StageWeights``); None under any other stage."""
        return self.sharding.stage_weights(chunks, self.options.reshard)

    def whole_weights(self, chunks: dict[int, nn.Module], write_back: bool = False):
        """A context in which every weight of ``chunks`` is whole (ZeRO-3 gathers them; with
        ``write_back`` what was loaded into them becomes the shards)."""
        weights = self.stage_weights(chunks)
        if weights is None:
            return contextlib.nullcontext()
        return weights.whole(write_back=write_back)

    def dp_state_tensors(self) -> list[torch.Tensor]:
        """What the reduction keeps between steps (PowerSGD's, the delayed mean)."""
        return self.reducer.state_tensors()

    # ----- the step ----------------------------------------------------------------------
    def start_step(self, num_microbatches: int, step: Optional[int] = None,
                   rounds: Optional[int] = None) -> None:
        """Declare the step's micro-batch count: after that many accumulations per parameter
        its gradient is final. Call before the step's first backward. ``step``: the optimizer
        step's number, 1-based (default: one more than the last). ``rounds``: the most
        micro-batches any DP replica runs this step (unequal shares; default this one's)."""
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) \
                or num_microbatches < 1:
            raise DataParallelConfigError(
                f"num_microbatches={num_microbatches!r} must be an integer >= 1")
        if self._microbatches is not None:
            raise RuntimeError("start_step() called twice; call finish_step() in between")
        for bucket in self.buckets:
            bucket.reset_step()
        self._next_launch = 0
        self.launched_in_backward = 0
        self._microbatches = num_microbatches
        self.sharding.pad_rounds((rounds or num_microbatches) - num_microbatches,
                                 num_microbatches)
        self.step = self.step + 1 if step is None else step
        self.reducer.start_step(self.step)

    def _accumulated(self, bucket: Bucket, slot: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of ``bucket.params[slot]``."""
        if self._microbatches is None:
            raise RuntimeError("a gradient was accumulated outside a step; call "
                               "GradSync.start_step(num_microbatches) before the first backward")
        expected = self._microbatches * self.uses[id(param)]
        count = bucket.accumulations[slot] + 1
        if count > expected:
            raise RuntimeError(f"parameter {self.specs[id(param)].name} accumulated {count} "
                               f"gradients in a step declared with {self._microbatches} "
                               f"micro-batches (x {self.uses[id(param)]} chunks using it); pass "
                               f"the true count to start_step()")
        bucket.accumulations[slot] = count
        if self.sharding.accumulated(bucket, slot, param):
            return
        if count == expected:
            bucket.check_grad_is_view(slot)
            bucket.final_params += 1
            if not bucket.late:
                self._launch_ready_in_order(in_backward=True)

    def _launch_ready_in_order(self, *, in_backward: bool) -> None:
        while self._next_launch < self.num_overlapped:
            bucket = self.buckets[self._next_launch]
            if in_backward and bucket.final_params < len(bucket.params):
                return
            self._launch(bucket)
            self.launched_in_backward += in_backward
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's mean over its placement's group (unless this step does not
        average gradients, or the group is this rank alone: an expert held by one rank)."""
        if bucket.group.size() == 1 or not self.reducer.averages_each_step:
            return
        self.reducer.launch(bucket, self.sharding.shard_of(bucket))

    def reduce_gradients(self) -> None:
        """Finish the step's gradient sync: start whatever did not start during backward
        (parameters that got no gradient this step), sum the late buckets over their own
        group then DP-reduce them, and wait for every collective."""
        if self._microbatches is None:
            raise RuntimeError("gradients reduced without start_step(); call "
                               "GradSync.start_step(num_microbatches) before the backward")
        self._microbatches = None
        if self.sharding.flush():
            return
        self._launch_ready_in_order(in_backward=False)
        for bucket in self.buckets[self.num_overlapped:]:
            if bucket.reduce_first.size() > 1:
                bucket.reduce_first.all_reduce(bucket.grad)
            self._launch(bucket)
        self.reducer.finish(self.buckets, self.wait)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """The global gradient norm (before clipping); scales gradients to ``max_norm`` when
        above it (``max_norm <= 0``: no clipping). Collective over the model group (and the
        sharding group when the state is sharded)."""
        norm = global_grad_norm(self._norm_grads, self.groups,
                                sharded_over_dp=self.sharding.shards_state)
        scale_grads_(self.sharding.grad_buffers(self.buckets), clip_coefficient(norm, max_norm))
        return norm

    def optimizer_step(self, lr: float) -> None:
        """AdamW step at ``lr``, then what the sharding does after it (ZeRO: gather the
        updated parameters)."""
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.sharding.after_optimizer_step()

    def zero_grad(self) -> None:
        """Zero the gradient buffers (``.grad`` stays a view of them)."""
        for grad in self.grad_tensors():
            grad.zero_()

    def finish_step(self, *, lr: float, max_norm: float,
                    check: Optional[Callable[[float], None]] = None) -> float:
        """Reduce, clip, step, zero; returns the global gradient norm before clipping.

        ``check(norm)`` runs after the norm is known and before the optimizer step: it may
        raise to stop a step whose update must not be applied (a non-finite norm). With
        ``dp_delay`` the norm is that of the mean applied (step 1 applies none: 0.0)."""
        self.reduce_gradients()
        apply = self.reducer.before_update()
        norm = self.clip_grad_norm_(max_norm) if apply else 0.0
        if check is not None:
            check(norm)
        if apply:
            self.optimizer_step(lr)
        self.reducer.after_update(self.step, self.optimizer)
        self.zero_grad()
        return norm

    def state_dict(self) -> dict:
        """AdamW's state per global parameter name (see ``hybrid.dp.state``); collective over
        the sharding group when the state is sharded."""
        return optimizer_state(self)

    def load_state_dict(self, states: dict) -> None:
        """Set AdamW's state from ``state_dict()`` output of any ZeRO stage or bucket size."""
        load_optimizer_state(self, states)

    def close(self) -> None:
        """Remove the gradient hooks (the model can then be used without this object)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.sharding.close()


def _replica_gradient_hooks(named: list[tuple[ParamSpec, nn.Parameter]], groups) -> list:
    """Hooks that make each gradient of a parameter whose placement sums other ranks' losses
    (``Placement.loss_role``: an expert's, its expert group's) one replica's, divided by
    their count before it accumulates. Every strategy (a mean, ZeRO's per-micro-batch
    reduce-scatter, PowerSGD's error feedback, local SGD's own steps, a delayed mean) then
    reduces it as any replica's gradient, over its placement's group."""
    hooks = []
    for spec, param in named:
        role = spec.placement.loss_role
        summed = groups.role(role).size() if role is not None else 1
        if summed > 1:
            hooks.append(param.register_hook(partial(torch.mul, other=1.0 / summed)))
    return hooks


def _check_settings(options: DpOptions, dp: int, bucket_mb: Any) -> None:
    problem = option_problem(options, dp)
    if problem:
        raise DataParallelConfigError(problem)
    if not bucket_mb > 0:
        raise DataParallelConfigError(f"parallel.bucket_mb={bucket_mb} must be > 0; "
                                      f"25 is torch DDP's default")


def _check_fp32(named: list[tuple[ParamSpec, nn.Parameter]]) -> None:
    for spec, param in named:
        if param.dtype != torch.float32:
            raise DataParallelConfigError(
                f"parameter {spec.name} is {param.dtype}; hybrid keeps fp32 master weights and "
                f"reduces gradients in fp32: keep parameters fp32 and use train.precision=bf16 "
                f"(autocast) for bf16 compute")
