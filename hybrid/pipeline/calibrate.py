"""Time each kind of block on the ranks, before training, for ``parallel.partition=measured``.

Where it runs and why: on every rank of the job, at once, with the job's own process groups,
device, micro-batch, precision and TP size. So the figures include what training pays (TP
collectives inside a block, cores shared by the ranks, the GPU's kernels) rather than one idle
process's view. Every rank times the same blocks in the same order, so the TP groups'
collectives inside a block pair up. The ranks then agree by gathering every rank's figures
and taking their mean (the same numbers, in the same order, on every rank, so every rank
computes bit-identical costs and the same partition): a mean, not a maximum, because the ranks
hold the same hardware and a maximum would keep each block's worst burst of a shared
machine's noise.

What is timed: the embedding, one transformer layer of each kind (``layer_spec``: a dense
layer, an MoE layer; the first of each) and the head with its loss, each forward and backward
as the runtime runs them (autocast on the forward only), the median of ``RUNS`` after a
warm-up. Layers of one kind are identical in shape and work, so one layer's time stands for
every layer of its kind: timing each would cost ``layers`` times as long and add only noise,
which would move the split from run to run for nothing. Only one block is built at a time.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from hybrid.planning.config import Config
from hybrid.planning.job import JobPlan
from hybrid.groups import ParallelGroups
from hybrid.planning.cost.block_costs import FILE_NAME, calibration_record, write_calibration
from hybrid.planning.models.layers import layer_specs
from hybrid.planning.schedules.partition import format_partition, partition

RUNS = 5
"""Timed forward + backward runs per block (after one warm-up); the median is kept."""


def forward_backward_seconds(forward: Callable[[], torch.Tensor], device: torch.device,
                             runs: int = RUNS, grad: Optional[torch.Tensor] = None,
                             precision: str = "fp32") -> tuple[float, float]:
    """Median seconds of ``forward()`` and of its output's backward (``grad``: the output's
    gradient; None for a scalar loss). On CUDA the queued kernels are waited for on both
    sides of each span, so a span measures the work and not its launch."""
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    forwards, backwards = [], []
    for run in range(runs + 1):  # run 0 warms up: allocations, kernel choice
        start = now()
        with autocast:
            out = forward()
        middle = now()
        out.backward(grad)
        end = now()
        if run:
            forwards.append(middle - start)
            backwards.append(end - middle)
    return statistics.median(forwards), statistics.median(backwards)


def timed_blocks(m) -> list[int]:
    """The blocks timed: the embedding, the first layer of each kind, the head."""
    firsts: dict = {}
    for block_id, spec in enumerate(layer_specs(m), start=1):
        firsts.setdefault(spec, block_id)
    return [0, *firsts.values(), m.layers + 1]


def measure_block_kinds(cfg: Config, groups: ParallelGroups,
                        runs: int = RUNS) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds of each of ``timed_blocks`` on this rank."""
    from hybrid.model import build_blocks, lm_loss  # megatron: only where blocks are built

    m, b = cfg.model, cfg.train.micro_batch
    sp = cfg.parallel.sequence_parallel and groups.layout.tp > 1
    local = m.seq_len // groups.layout.cp  # this rank's chunks under context parallelism
    seq = local // groups.layout.tp if sp else local
    data = torch.Generator().manual_seed(cfg.seed)  # the same inputs on every TP rank
    tokens = torch.randint(0, m.vocab, (b, local), generator=data).to(groups.device)
    hidden = torch.randn(seq, b, m.hidden, generator=data).to(groups.device)
    grad = torch.randn(seq, b, m.hidden, generator=data).to(groups.device)
    forwards, backwards = [], []
    for block_id in timed_blocks(m):
        block = build_blocks(m, groups, seed=cfg.seed, block_ids=[block_id],
                             sequence_parallel=sp, cp_comm=cfg.parallel.cp_comm)[0]
        if block_id == 0:
            timed = forward_backward_seconds(lambda: block(tokens), groups.device, runs, grad,
                                             cfg.train.precision)
        else:
            x = hidden.clone().requires_grad_()
            if block_id == m.layers + 1:
                timed = forward_backward_seconds(lambda: lm_loss(block(x), tokens, groups, m.vocab),
                                                 groups.device, runs, None, cfg.train.precision)
            else:
                timed = forward_backward_seconds(lambda: block(x), groups.device, runs, grad,
                                                 cfg.train.precision)
        forwards.append(timed[0])
        backwards.append(timed[1])
        block = None  # one block at a time: a large head and a layer never share the memory
    return forwards, backwards


def agreed_block_seconds(cfg: Config, groups: ParallelGroups,
                         runs: int = RUNS) -> tuple[list[float], list[float]]:
    """Per block (embedding, every layer, head): forward and backward seconds, the mean over
    every rank of the job, identical on every rank."""
    forwards, backwards = measure_block_kinds(cfg, groups, runs)
    mine = torch.tensor(forwards + backwards, dtype=torch.float64, device=groups.device)
    everyone = [torch.empty_like(mine) for _ in range(groups.world.size())]
    groups.world.all_gather(everyone, mine)
    mean = torch.stack(everyone).mean(dim=0).tolist()
    timed = timed_blocks(cfg.model)
    kinds = layer_specs(cfg.model)
    # each block takes the time of the timed block of its kind
    source = [0] + [timed.index(kinds.index(spec) + 1) for spec in kinds] + [len(timed) - 1]

    def per_block(seconds: list[float]) -> list[float]:
        return [seconds[i] for i in source]

    return per_block(mean[:len(timed)]), per_block(mean[len(timed):])


def settle_measured_partition(plan: JobPlan, groups: ParallelGroups, run_dir: Path
                              ) -> JobPlan:
    """``plan`` with its stages split by measured costs, for partition=measured without known
    costs (the launcher has read an existing ``partition_file`` already: then, and for any
    other partition, ``plan`` unchanged). Rank 0 writes the calibration file and prints the
    stages it gives; every rank gets the same costs, so the same plan."""
    if plan.costs_measured:
        return plan
    cfg, par = plan.cfg, plan.cfg.parallel
    forwards, backwards = agreed_block_seconds(cfg, groups)
    record = calibration_record(
        cfg, forwards, backwards, ranks=dist.get_world_size(),
        how=f"median of {RUNS} runs per block kind on each rank, mean over the ranks")
    costs = record["cost_s"]
    if dist.get_rank() == 0:
        path = Path(par.partition_file) if par.partition_file else run_dir / FILE_NAME
        write_calibration(path, record)
        stages = partition(costs, groups.layout.pp, groups.layout.vpp, mode="measured")
        print(f"measured block costs (forward + backward, ms): embedding "
              f"{costs[0] * 1e3:.2f}, layer {costs[1] * 1e3:.2f}, head "
              f"{costs[-1] * 1e3:.2f}; written to {path}", flush=True)
        print(format_partition(stages, groups.layout.pp,
                               costs=[round(c * 1e3, 2) for c in costs]), flush=True)
    return plan.with_block_costs(costs)
