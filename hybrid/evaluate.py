"""Validation loss on any layout: the training schedule's forwards alone, on held-out data.

After every ``eval.every``-th step (and after the last with ``eval.at_end``) the ranks run
``eval.batches`` global batches of the validation data (``hybrid.data.open_eval_dataset``: the
same batches every time, read in order) through the pipeline with the schedule's forward
actions only (``schedules.forward_only``, checked like any schedule), under ``no_grad``: TP,
sequence parallelism and the stage placement are those of training; DP ranks each take their
share of every batch. Every batch has ``global_batch * seq_len`` tokens, so the mean of the
batches' means is the exact token-weighted mean over all of them; one all-reduce over the
pipeline and one over the loss group (the DP replicas) make it known everywhere.

Nothing of training is touched: no gradient, no optimizer state, no random number, no data
position (the training data's position is a function of the step alone). A resumed run keeps
the cadence, which counts steps from the run's start.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch

from hybrid.data import TokenDataset, rank_microbatches
from hybrid.groups import ParallelGroups
from hybrid.model import lm_loss
from hybrid.pipeline.runtime import prepare_rank, run_pipeline_step
from hybrid.pipeline.stages import activation_shape, lowered_schedule
from hybrid.planning.data_sources import eval_cadence, evaluates
from hybrid.planning.job import JobPlan

EVAL_KEYS = ("eval_loss", "eval_ppl", "eval_tokens", "eval_s")


def eval_schedule(plan: JobPlan) -> list[list]:
    """Every pipeline rank's forward-only list, proved complete and deadlock-free."""
    return lowered_schedule(plan, forward=True)


class Evaluator:
    """The evaluations of one rank's run (``due(step)``, then ``evaluate(...)``)."""

    def __init__(self, plan: JobPlan, groups: ParallelGroups, chunks: dict,
                 dataset: TokenDataset, *, progress=None, weights=None):
        """``weights``: ZeRO-3's gathers (``GradSync.stage_weights``), or None."""
        self.plan, self.groups, self.chunks, self.dataset = plan, groups, chunks, dataset
        self.cfg = plan.cfg
        self.progress, self.weights = progress, weights
        layout = plan.layout
        actions = eval_schedule(plan)[groups.pp_rank]
        self.rank_plan = prepare_rank(actions, chunks, groups=groups, pp=layout.pp,
                                      vpp=layout.vpp, m=plan.schedule.microbatches,
                                      placement=layout.stage_placement, forward_only=True)

    def due(self, step: int) -> bool:
        every, at_end = eval_cadence(self.cfg.eval, self.cfg.data)
        return bool(every and step % every == 0) or (at_end and step == self.cfg.train.steps)

    def evaluate(self, autocast) -> dict:
        """The validation loss of the model as it is now (identical on every rank)."""
        start = time.perf_counter()
        cfg, layout = self.cfg, self.plan.layout
        total = torch.zeros(1, dtype=torch.float64, device=self.groups.device)
        for batch in range(cfg.eval.batches):
            data = [(x.to(self.groups.device), y.to(self.groups.device)) for x, y in
                    rank_microbatches(self.dataset, batch, global_batch=cfg.train.global_batch,
                                      micro_batch=cfg.train.micro_batch,
                                      dp=self.groups.data.size(), dp_rank=self.groups.data.rank(),
                                      seed=cfg.seed, cp=self.groups.context.size(),
                                      cp_rank=self.groups.context.rank())]
            with autocast():
                loss = run_pipeline_step(
                    self.rank_plan, self.chunks, data, groups=self.groups, pp=layout.pp,
                    vpp=layout.vpp, act_shape=activation_shape(self.plan),
                    loss_fn=lambda logits, labels: lm_loss(logits, labels, self.groups,
                                                           cfg.model.vocab),
                    act_dtype=torch.float32, progress=self.progress,
                    recv_timeout_s=cfg.train.collective_timeout_s,
                    placement=layout.stage_placement, forward_only=True,
                    weights=self.weights)
            total += 0.0 if loss is None else loss
        self.groups.pipeline.all_reduce(total)  # only the last stage holds a loss
        self.groups.loss.all_reduce(total)
        mean = total.item() / self.groups.loss.size() / cfg.eval.batches
        return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 700.0)),
                "eval_tokens": cfg.eval.batches * cfg.train.global_batch * cfg.model.seq_len,
                "eval_s": time.perf_counter() - start}


def make_evaluator(plan: JobPlan, groups: ParallelGroups, chunks: dict,
                   dataset: Optional[TokenDataset], progress=None,
                   weights=None) -> Optional[Evaluator]:
    """The run's evaluator, or None when it does not evaluate."""
    if not evaluates(plan.cfg.eval, plan.cfg.data):
        return None
    if dataset is None:
        from hybrid.data import open_eval_dataset

        dataset = open_eval_dataset(plan)
    return Evaluator(plan, groups, chunks, dataset, progress=progress, weights=weights)
