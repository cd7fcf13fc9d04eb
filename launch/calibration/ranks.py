"""What each rank of ``hybrid-plan calibrate`` times (``launch.calibration.calibrate`` fits the device to
it): hybrid's transformer layer alone and split as tensor parallelism, the step after the
backward, and gloo's collectives. Every function here runs inside ``hybrid.testing.spawn``'s
processes; ranks that time something collective run it the same number of times
(``_all_go_on``)."""

from __future__ import annotations

import itertools
import statistics
import time

SHAPES = tuple(itertools.product((128, 256, 512), (256, 1024)))  # (hidden, rows)
BF16_SHAPE = (128, 256)  # bf16 runs ~50x slower than fp32 on CPUs without bf16 units
TP_SHAPE = (256, 256)  # few tokens: the per-call cost stands out from the ring time
SEQ = 128
OPTIMIZER_PARAMS = 2**21
SMALL_BYTES, LARGE_BYTES = 8, 4 * 2**20
ALTERNATIONS = 5
"""Times a figure that compares two timings takes each of them, in turn (the median kept)."""


def layer_seconds(hidden: int, rows: int, dtype_name: str, min_seconds: float, group) -> float:
    """Median seconds of one forward + backward of hybrid's transformer layer."""
    once = _layer_run(hidden, rows, dtype_name, group)
    once()  # warm-up
    return median_seconds(once, min_seconds, group)


def median_seconds(work, min_seconds: float, group=None) -> float:
    """Median seconds of ``work()``, run for at least ``min_seconds`` and 3 times; with a
    ``group`` whose ranks run it collectively, as often on every rank (``_all_go_on``)."""
    times, started = [], time.perf_counter()
    while _all_go_on(time.perf_counter() - started < min_seconds or len(times) < 3, group):
        begun = time.perf_counter()
        work()
        times.append(time.perf_counter() - begun)
    return statistics.median(times)  # a shared machine's bursts fall outside the median


def _layer_run(hidden: int, rows: int, dtype_name: str, group, heads: int = 0,
               sequence_parallel: bool = False):
    """One forward + backward of a new layer of hybrid's, as a function to time (with
    sequence parallelism, on this rank's ``1 / group.size()`` of the sequence)."""
    import torch

    from hybrid.planning.config import ModelConfig
    from hybrid.model.blocks import TransformerLayer

    m = ModelConfig(hidden=hidden, heads=heads or max(1, hidden // 64), seq_len=SEQ)
    layer = TransformerLayer(m, group, generator=torch.Generator().manual_seed(0),
                             sequence_parallel=sequence_parallel)
    seq = SEQ // group.size() if sequence_parallel else SEQ
    x = torch.randn(seq, rows // SEQ, hidden, requires_grad=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype_name == "bf16")

    def once() -> None:
        with autocast:
            out = layer(x)
        out.backward(torch.ones_like(out))

    return once


def _all_go_on(mine: bool, group) -> bool:
    """Whether any rank of ``group`` wants another run: ranks that time a collective layer
    must run it the same number of times, or one waits forever in a collective the others
    never join (each rank's clock passes ``min_seconds`` at its own run)."""
    if group is None or group.size() == 1:
        return mine
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(mine)])
    group.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def layer_flops(hidden: int, rows: int) -> float:
    """Forward + backward FLOPs of one layer (``hybrid.planning.cost.steptime``'s count)."""
    from hybrid.planning.config import ModelConfig
    from hybrid.planning.cost.flops import layer_forward_flops

    m = ModelConfig(hidden=hidden, heads=max(1, hidden // 64), seq_len=SEQ)
    return 3 * layer_forward_flops(m, rows // SEQ)


def own_group(rank: int, world: int):
    """This rank's own 1-rank TP group, as hybrid's layers take it (a collective: every rank
    makes every rank's)."""
    import torch.distributed as dist

    from hybrid.comm import Group

    return Group([dist.new_group([r]) for r in range(world)][rank], [rank], "tp", "gloo")


def compute_rates(rank: int, world: int, min_seconds: float, threads: int,
                   shapes=SHAPES) -> dict:
    """FLOP/s of the layer by shape (fp32), bf16 at one shape, and the seconds per parameter
    of the work after the backward, on ``threads`` threads while every rank runs the same."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    own = own_group(rank, world)
    dist.barrier()  # every core starts together
    rates = {f"{h}x{rows}": layer_flops(h, rows) / layer_seconds(h, rows, "fp32", min_seconds,
                                                                    own)
             for h, rows in shapes}
    h, rows = BF16_SHAPE
    rates["bf16"] = layer_flops(h, rows) / layer_seconds(h, rows, "bf16", min_seconds, own)
    rates["optimizer_s_per_param"] = _optimizer_seconds() / OPTIMIZER_PARAMS
    return rates


def thread_speedups(rank: int, world: int, min_seconds: float, shapes) -> dict[int, float]:
    """By rows: how much faster rank 0 runs the layer on ``world`` threads alone than on one
    while every rank runs it, timed in turn ``ALTERNATIONS`` times (the median ratio), so that
    both figures see the machine's same moods (the others wait in a barrier, which costs no
    CPU). Rank 0's answer is the one kept."""
    import torch
    import torch.distributed as dist

    own = own_group(rank, world)
    ratios = {rows: [] for _, rows in shapes}
    for _ in range(ALTERNATIONS):
        for h, rows in shapes:
            torch.set_num_threads(1)
            dist.barrier()
            loaded = layer_seconds(h, rows, "fp32", min_seconds / ALTERNATIONS, own)
            dist.barrier()
            if rank == 0:
                torch.set_num_threads(world)
                ratios[rows].append(loaded / layer_seconds(h, rows, "fp32",
                                                           min_seconds / ALTERNATIONS, own))
            dist.barrier()
    return {rows: statistics.median(r) for rows, r in ratios.items() if r}


def _optimizer_seconds() -> float:
    """A step's work per parameter after the backward: the gradient norm, clipping, AdamW and
    zeroing the gradients (what ``GradSync.finish_step`` does besides communicating)."""
    import torch

    from hybrid.planning.config import OptimConfig
    from hybrid.optim import build_adamw

    params = [torch.nn.Parameter(torch.randn(OPTIMIZER_PARAMS // 4)) for _ in range(4)]
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    optimizer = build_adamw([(p, True) for p in params], OptimConfig())

    def step() -> None:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        torch._foreach_mul_(grads, float(1.0 / max(1.0, norm.item())))
        optimizer.step()
        torch._foreach_zero_(grads)
        torch._foreach_add_(grads, 1e-3)  # gradients again for the next step

    step()  # creates the moments
    started = time.perf_counter()
    for _ in range(5):
        step()
    return (time.perf_counter() - started) / 5


def tp_call_seconds(rank: int, world: int, min_seconds: float) -> tuple[float, ...]:
    """Mean (wall, CPU) seconds of one of the TP collectives of the layer split over the
    ``world`` ranks (one thread each, ``TP_SHAPE``), each timed from its issue to its end,
    then the same with sequence parallelism (its all-gathers and reduce-scatters): each run
    for ``min_seconds``, so that the means take in the waits of a group larger than the
    cores for a member without a core; last, ``_shard_ratio``."""
    import torch

    torch.set_num_threads(1)
    figures = ()
    for sequence_parallel in (False, True):
        figures += _mean_call(world, min_seconds, sequence_parallel)
    return figures + (_shard_ratio(rank, world, min_seconds),)


def _shard_ratio(rank: int, world: int, min_seconds: float) -> float:
    """One rank's ``world``-way TP shard of the layer (its collectives not issued) over the
    whole layer on that rank, both at ``TP_SHAPE`` on one thread while every rank runs the
    same, timed in turn ``ALTERNATIONS`` times (the median): the shard's compute alone."""
    import torch.distributed as dist

    from hybrid.comm import Group

    shard_group = Group(dist.group.WORLD, list(range(world)), "tp", "gloo",
                        observer=_SkipCollectives())
    shard = _layer_run(*TP_SHAPE, "fp32", shard_group, _tp_heads(world))
    whole = _layer_run(*TP_SHAPE, "fp32", own_group(rank, world))
    shard()
    whole()  # warm-up
    ratios = []
    for _ in range(ALTERNATIONS):
        dist.barrier()
        whole_s = median_seconds(whole, min_seconds / ALTERNATIONS)
        dist.barrier()
        ratios.append(median_seconds(shard, min_seconds / ALTERNATIONS) / whole_s)
    return statistics.median(ratios)


def _tp_heads(ways: int) -> int:
    """Heads of the ``TP_SHAPE`` layer split ``ways`` ways: every rank holds whole heads."""
    return max(TP_SHAPE[0] // 64, ways)


class _SkipCollectives:
    """A ``Group``'s observer that issues none of its collectives: a TP layer computes as
    it would, on its own rank's shard, with nothing to wait for (its sums are wrong, which
    timing does not mind; the layer's TP collectives all work in place)."""

    active = True

    def collective(self, group, op, kind, payload, issue, waits: bool, sent: int = 0):
        return None


def _mean_call(world: int, min_seconds: float, sequence_parallel: bool) -> tuple[float, float]:
    import torch.distributed as dist

    from hybrid.comm import Group

    timer = _CallTimer()
    timed = Group(dist.group.WORLD, list(range(world)), "tp", "gloo", observer=timer)
    every = Group(dist.group.WORLD, list(range(world)), "tp", "gloo")
    run = _layer_run(*TP_SHAPE, "fp32", timed, _tp_heads(world), sequence_parallel)
    run()  # warm-up
    timer.calls, timer.wall, timer.cpu = 0, 0.0, 0.0
    started = time.perf_counter()
    while _all_go_on(time.perf_counter() - started < min_seconds or timer.calls < 20, every):
        run()
    return timer.wall / timer.calls, timer.cpu / timer.calls


class _CallTimer:
    """Stands in for a ``Group``'s observer: times each collective from its issue to its end
    (wall and this process's CPU)."""

    active = True

    def __init__(self) -> None:
        self.calls, self.wall, self.cpu = 0, 0.0, 0.0

    def collective(self, group, op, kind, payload, issue, waits: bool, sent: int = 0):
        cpu, begun = time.process_time(), time.perf_counter()
        work = issue()
        if waits and work is not None:
            work.wait()  # the caller's wait then returns at once
        self.wall += time.perf_counter() - begun
        self.cpu += time.process_time() - cpu
        self.calls += 1
        return work


def collective_times(rank: int, world: int, repeats: int) -> tuple[float, ...]:
    """Median seconds of an all-reduce of SMALL_BYTES and of LARGE_BYTES, and of an
    all-gather and a reduce-scatter of LARGE_BYTES in all."""
    import torch
    import torch.distributed as dist

    def timed(collective) -> float:
        collective()  # warm-up: connections, buffers
        times = []
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            collective()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    small, whole = torch.ones(SMALL_BYTES // 4), torch.ones(LARGE_BYTES // 4)
    shard = torch.ones(LARGE_BYTES // 4 // world)
    return (timed(lambda: dist.all_reduce(small)), timed(lambda: dist.all_reduce(whole)),
            timed(lambda: dist.all_gather_single(whole, shard)),
            timed(lambda: dist.reduce_scatter_single(shard, whole)))
