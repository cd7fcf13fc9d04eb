"""The per-rank training loop: stages, schedule, data, gradient sync, metrics, timeline.

Every rank runs ``train(plan, groups, run_dir)`` with the job's frozen plan
(``hybrid.planning.job``). Per optimizer step it loads its data group's share of the global
batch, runs its pipeline rank's action list (forward/backward of micro-batches), lets
``GradSync`` reduce, clip and step, and reports metrics reduced over the job.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.diagnosis import faults
from hybrid.checkpoint.checkpointer import Checkpointer
from hybrid.comm import CommCounter
from hybrid.data import TokenDataset, open_dataset, rank_microbatches
from hybrid.evaluate import make_evaluator
from hybrid.dp import GradSync
from hybrid.groups import ParallelGroups
from hybrid.memory_check import check_memory, saved_tensors
from hybrid.metrics import MetricsWriter, peak_memory_bytes
from hybrid.model import lm_loss
from hybrid.model.activations import SavedTensors
from hybrid.model.expert_bias import update_expert_biases
from hybrid.model.moe import moe_step_stats, set_aux_loss_scale
from hybrid.optim import lr_at
from hybrid.pipeline.recorder import ActionRecorder, write_step_timeline
from hybrid.pipeline.runtime import prepare_rank, run_pipeline_step
from hybrid.pipeline.stages import activation_shape, build_chunks, lowered_schedule
from hybrid.balance.relayout import relayout_asked
from hybrid.balance.replicas import ReplicaShares
from hybrid.balance.stages import StageSplit, move_state, resumed_plan
from hybrid.planning.job import JobPlan
from hybrid.planning.schedules.rank_check import RankPlan
from hybrid.diagnosis.stall import who
from hybrid.step_record import StepReport, metrics_record, stop_if_not_finite
from hybrid.diagnosis.stragglers import WAIT_AXES, RankTimesLog, warning_line
from hybrid.diagnosis.watch import REPORT_GRACE_S, RankWatch, publish_pid, stall_error


class Trainer:
    """Everything one rank holds for a run of ``plan``; ``run()`` trains
    ``cfg.train.steps`` steps. The plan is used as it is: nothing is planned again here."""

    def __init__(self, plan: JobPlan, groups: ParallelGroups, run_dir: Path,
                 store: Optional[dist.Store] = None, dataset: Optional[TokenDataset] = None,
                 eval_dataset: Optional[TokenDataset] = None):
        cfg = plan.cfg
        plan = resumed_plan(plan, run_dir)  # pp_balance=dynamic: the checkpoint's own split
        self.cfg, self.groups, self.run_dir, self.store = cfg, groups, run_dir, store
        self.device = groups.device
        world = range(dist.get_world_size())
        self.shares = ReplicaShares(plan, groups.data.rank(),
                                    [self.coords_of(r)["dp"] for r in world])
        """The DP replicas' shares of the step's micro-batches (``parallel.dp_balance``)."""
        self.split = StageSplit(plan, groups, [self.coords_of(r)["pp"] for r in world])
        """The pipeline stages' layer split (``parallel.pp_balance``)."""
        self.m = plan.schedule.microbatches
        """Micro-batches per replica under even shares (what each loss is divided by)."""
        self.schedules = {self.m: lowered_schedule(plan)}
        """Every pipeline rank's lists, by micro-batch count (dp_balance=dynamic runs several)."""
        self.schedule, self._schedule_m = self.schedules[self.m], self.m
        self.actions = self.schedule[groups.pp_rank]
        # an indexed source is opened by the worker before torch.distributed starts
        self.dataset = dataset if dataset is not None else open_dataset(plan)
        self.eval_dataset = eval_dataset
        self.watch = RankWatch(dist.get_rank())
        publish_pid(store, dist.get_rank(), socket.gethostname())
        self.counter = CommCounter(groups, watch=self.watch)
        self.slow = faults.slow_seconds(dist.get_rank())
        self.act_shape = activation_shape(plan)
        self._build_stages(plan)
        self.start_step = self.checkpointer.resume()
        """The step the run resumes after (0: a fresh run)."""

    def _build_stages(self, plan: JobPlan) -> None:
        """This rank's chunks of ``plan``'s split, and what holds them: the gradient sync
        and optimizer, ZeRO-3's weights, the evaluator, the checkpointer (fresh state)."""
        self.plan = plan
        self.chunks = {s: c.to(self.device) for s, c in build_chunks(plan, self.groups).items()}
        self._planned: Optional[tuple[list, RankPlan]] = None  # (actions, their plan)
        # as each micro-batch's loss is divided by the even count (replicas' shares or not)
        set_aux_loss_scale(self.chunks.values(), 1.0 / self.m)
        self.sync = GradSync.from_config(list(self.chunks.values()), self.groups, self.cfg,
                                         wait=self.watch.wait_async)
        self.weights = self.sync.stage_weights(self.chunks)
        """ZeRO-3: what runs the schedule's gathers and releases (else None)."""
        self.evaluator = make_evaluator(plan, self.groups, self.chunks, self.eval_dataset,
                                        progress=self.watch, weights=self.weights)
        self.checkpointer = Checkpointer(plan, self.groups, self.chunks, self.sync,
                                         self.run_dir, shares=self.shares)

    def _resplit(self, step: int, ranges: list, how: Optional[str] = None) -> None:
        """``parallel.pp_balance=dynamic`` moved layers: the state goes to the new split's
        stages (``hybrid.balance.stages.move_state``) before step ``step + 1``; ``how``:
        memory or checkpoint (default ``parallel.pp_balance_move``; ``bench/pp_move.py``
        times both)."""
        def rebuild() -> Checkpointer:
            self.sync.close()
            self._build_stages(self.plan.with_stage_ranges(ranges))
            return self.checkpointer

        started = time.perf_counter()
        move_state(self.checkpointer, rebuild, step, how=how or self.cfg.parallel.pp_balance_move)
        self.split.restart_window(time.perf_counter() - started, self.groups.world)

    def set_watching(self, on: bool) -> None:
        """Wait timing and stall diagnosis on or off (off: compute is the whole step): only
        ``bench/watch_overhead.py`` turns them off, to measure what they cost."""
        self.watch.enabled = on

    def coords_of(self, rank: int) -> dict[str, int]:
        """A global rank's (dp, cp, tp, pp) coordinates; cp only where the layout has it."""
        layout = self.groups.layout
        coords = layout.coords(rank % layout.world_size)
        return coords if layout.cp > 1 else {k: v for k, v in coords.items() if k != "cp"}

    def node_of(self, rank: int) -> int:
        return self.plan.node_of(rank % self.groups.layout.world_size)

    def _autocast(self):
        if self.cfg.train.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t, data = self.cfg.train, self.groups.data
        pairs = rank_microbatches(self.dataset, step - 1, global_batch=t.global_batch,
                                  micro_batch=t.micro_batch, dp=data.size(),
                                  dp_rank=data.rank(), seed=self.cfg.seed,
                                  cp=self.groups.context.size(),
                                  cp_rank=self.groups.context.rank(),
                                  shares=self.shares.loader_shares())
        # No per-step id check here: validate_data scanned the token file before launch and
        # the dataset checks each window as it reads it (every model-parallel rank reads the
        # same windows, so a bad one stops them all alike).
        return [(x.to(self.device), y.to(self.device)) for x, y in pairs]

    def step(self, step: int, recorder=None) -> StepReport:
        data_start = time.perf_counter()
        data = self._microbatches(step)
        data_s = time.perf_counter() - data_start
        lr = lr_at(step, self.cfg.optim, self.cfg.train.steps)
        start, cpu_start = time.perf_counter(), time.process_time()
        self.counter.reset()
        self.watch.start_step(step)
        self._use_schedule_of(self.shares.mine)
        self.sync.start_step(self.shares.mine, step=step, rounds=max(self.shares.shares))
        if self.weights is not None:
            self.weights.reset_peak()
        try:
            with self.counter.track():
                loss = self._forward_backward(step, data, recorder)
                pipeline_s = time.perf_counter() - start - sum(self.watch.wait_s.values())
                global_loss = []

                def check(norm: float) -> None:  # before the update is applied
                    global_loss.append(self._global_loss(loss))
                    stop_if_not_finite(step, global_loss[0], norm, lr)

                grad_norm = self.sync.finish_step(lr=lr, max_norm=self.cfg.train.grad_clip,
                                                  check=check)
                update_expert_biases(self.chunks.values(), self.groups.loss)  # if any
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
                waits = [self.watch.wait_s[axis] for axis in WAIT_AXES]
                times = self._gather([elapsed, peak_memory_bytes(self.device), cpu,
                                      elapsed - sum(waits), *waits, pipeline_s, data_s])
        except Exception as error:
            if self.watch.waiting is None:
                raise  # not a failed wait: the error speaks for itself
            raise self._stall_error(error) from error
        return StepReport(loss=global_loss[0], grad_norm=float(grad_norm), lr=lr,
                          step_time_s=max(t[0] for t in times), comm=self.counter.snapshot(),
                          dp_group_bytes=self.counter.axis_group_bytes("dp"),
                          cpu_s=sum(t[2] for t in times),
                          peak_mem_bytes=int(max(t[1] for t in times)),
                          compute_s=[t[3] for t in times],
                          wait_s={axis: [t[4 + i] for t in times]
                                  for i, axis in enumerate(WAIT_AXES)},
                          moe=moe_step_stats(self.chunks.values()),
                          data_s=max(t[-1] for t in times),
                          pipeline_s=[t[-2] for t in times],
                          dp_shares=self.shares.record().get("dp_shares"))

    def _forward_backward(self, step: int, data, recorder) -> Optional[float]:
        if self.slow is not None and step >= self.slow[0]:
            time.sleep(self.slow[1])  # a test's straggler (hybrid.diagnosis.faults): slow compute
        with self._autocast():
            return run_pipeline_step(
                self._rank_plan(), self.chunks, data, groups=self.groups,
                pp=self.groups.layout.pp, vpp=self.groups.layout.vpp,
                loss_fn=lambda logits, labels: lm_loss(logits, labels, self.groups,
                                                       self.cfg.model.vocab),
                act_shape=self.act_shape, act_dtype=torch.float32, recorder=recorder,
                recv_timeout_s=self.cfg.train.collective_timeout_s, progress=self.watch,
                placement=self.groups.layout.stage_placement, weights=self.weights,
                loss_divisor=self.m)

    def _use_schedule_of(self, m: int) -> None:
        """This step's action lists: the replica's own count's (built once per count)."""
        if m == self._schedule_m:
            return  # (a bench may have swapped in its own list for this count)
        if m not in self.schedules:
            self.schedules[m] = lowered_schedule(self.plan, m=m)
        self.schedule, self._schedule_m = self.schedules[m], m
        self.actions = self.schedule[self.groups.pp_rank]

    def _rank_plan(self) -> RankPlan:
        """``self.actions`` checked and planned once, not every step (a bench may swap in
        another list: it is planned when first used)."""
        if self._planned is None or self._planned[0] is not self.actions:
            layout = self.groups.layout
            plan = prepare_rank(self.actions, self.chunks, groups=self.groups, pp=layout.pp,
                                vpp=layout.vpp, m=self._schedule_m,
                                placement=layout.stage_placement)
            self._planned = (self.actions, plan)
        return self._planned[1]

    def _stall_error(self, error: BaseException) -> Exception:
        """A wait failed: the diagnosis, after hearing from every rank that can still speak."""
        return stall_error(
            self.watch, error, coords_of=self.coords_of, node_of=self.node_of,
            world=dist.get_world_size(), host=socket.gethostname(), store=self.store,
            run_dir=self.run_dir,
            grace_s=min(REPORT_GRACE_S, self.cfg.train.collective_timeout_s / 2))

    def _global_loss(self, loss: Optional[float]) -> float:
        """The step's loss on the whole global batch: from the last stage, mean over the
        loss group (the DP replicas)."""
        value = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64,
                             device=self.device)
        self.groups.pipeline.all_reduce(value)  # only the last stage holds a loss
        self.groups.loss.all_reduce(value)
        return value.item() / self.groups.loss.size()

    def _gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (one all-gather over the job), by rank."""
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64,
                          device=self.device)
        self.groups.world.all_gather_into(out, mine)
        return out.view(-1, len(values)).tolist()

    def run(self) -> dict:
        cfg = self.cfg
        is_rank0 = dist.get_rank() == 0
        metrics = MetricsWriter(self.run_dir, cfg.train.steps, enabled=is_rank0,
                                log_every=cfg.train.log_every, first_step=self.start_step + 1)
        times = self._times_log() if is_rank0 else None
        if is_rank0:
            self.checkpointer.say_where_it_starts(self.start_step)
        losses, norms, evals = [], [], {}
        stopped_at = None
        checking = True  # until the first step that updates (dp_delay's step 1 does not)
        try:
            for step in range(self.start_step + 1, cfg.train.steps + 1):
                recorder = self._recorder_for(step)
                with saved_tensors(self.chunks.values(), checking) as saved:
                    report = self.step(step, recorder)
                if checking and self.sync.optimizer.state:
                    self._check_memory(saved)
                    checking = False
                faults.maybe_die("die_at_step", step=step, rank=dist.get_rank())
                ran = self.shares.of_ranks()  # the micro-batches of this step, not the next
                self.shares.after_step(step, report.compute_s, report.pipeline_s, say=is_rank0)
                moved = self.split.after_step(step, report.pipeline_s, ran, say=is_rank0,
                                              final=step >= cfg.train.steps)
                losses.append(report.loss)
                norms.append(report.grad_norm)
                evaluation = self._evaluate(step)
                if evaluation:
                    evals[step] = evaluation["eval_loss"]
                if times is not None:
                    metrics.write({**self._record(step, report, times), **evaluation})
                if recorder is not None:
                    self._write_timeline(recorder, step)
                if moved is not None and step < cfg.train.steps:
                    self._resplit(step, moved)  # before a save: a resume keeps the new split
                self.checkpointer.after_step(step)
                if step < cfg.train.steps and relayout_asked(cfg, self.store, self.groups, step):
                    stopped_at = step
                    break
            self.checkpointer.close()
        finally:
            metrics.close()
            if times is not None:
                times.close()
            self.sync.close()
        return {"losses": losses, "grad_norms": norms, "eval_losses": evals,
                "initialised_from": self.checkpointer.initialised_from,
                "run_dir": str(self.run_dir),
                "start_step": self.start_step, "resumed_from": self.checkpointer.resumed_from,
                "relayout_at": stopped_at}

    def _evaluate(self, step: int) -> dict:
        """The validation loss when ``step`` is an evaluation step, on every rank, else {}."""
        if self.evaluator is None or not self.evaluator.due(step):
            return {}
        return self.evaluator.evaluate(self._autocast)

    def _check_memory(self, saved: SavedTensors) -> None:
        gathered = 0 if self.weights is None else self.weights.peak_bytes
        check_memory(self.run_dir, self.plan, self.chunks.values(), self.sync, saved, gathered,
                     self._gather)

    def _times_log(self) -> RankTimesLog:
        pp_of_rank = [self.coords_of(r)["pp"] for r in range(dist.get_world_size())]
        return RankTimesLog(self.run_dir / "rank_times.jsonl", pp_of_rank,
                            self.cfg.train.straggler_ratio, append=self.start_step > 0)

    def _record(self, step: int, report: StepReport, times: RankTimesLog) -> dict:
        """Rank 0: the step's ``metrics.jsonl`` record; warns of a straggler on the way."""
        summary, stragglers = times.add(step, report.compute_s, report.wait_s,
                                         report.step_time_s)
        for straggler in stragglers:
            name = who(straggler.rank, self.coords_of, self.node_of)
            print(warning_line(straggler, name) + self.shares.straggler_clause(
                straggler.rank, straggler.ratio), file=sys.stderr, flush=True)
        return {**metrics_record(self.plan, step, report, summary), **self.split.record()}

    def _recorder_for(self, step: int) -> Optional[ActionRecorder]:
        if step != self.cfg.train.timeline_step:
            return None
        return ActionRecorder(rank=self.groups.pp_rank)

    def _write_timeline(self, recorder: ActionRecorder, step: int) -> None:
        write_step_timeline(recorder, self.schedule, self.groups, self.run_dir, step=step,
                            m=self.shares.mine, schedule=self.cfg.parallel.schedule)

def train(plan: JobPlan, groups: ParallelGroups, run_dir: Path,
          store: Optional[dist.Store] = None, dataset: Optional[TokenDataset] = None,
          eval_dataset: Optional[TokenDataset] = None) -> dict:
    """``store``: the job's key-value store, where a failed rank hears the others' reports;
    ``dataset``/``eval_dataset``: the training and validation data, opened before the process
    group (else opened here)."""
    return Trainer(plan, groups, run_dir, store, dataset, eval_dataset).run()
