"""``hybrid-plan calibrate``: measure this machine for the cost model and write a device file.

What it measures, the way training uses the machine (gloo between ranks; each rank with the
threads ``hybrid-train`` gives it):

- **Compute**: the forward and backward of hybrid's own transformer layer (so norms,
  attention, GELU and the framework's per-operation cost are in the figure, not only the
  matrix multiplies) for several widths ``h`` and token counts ``rows`` per micro-batch, on one
  thread in every core's process at once (what a full node gets). ``rate = flops · h/(h +
  half_width) · rows/(rows + half_rows)`` fitted to those gives the device's ``flops``,
  ``matmul_half_width`` and ``matmul_half_rows``; bf16 at one small shape, scaled alike. The same
  layer on every core in one process, timed in turn with the loaded figure, gives
  ``thread_speedup`` (a single rank's threads).
- **After the backward**: seconds per parameter of the gradient norm, clipping, hybrid's
  AdamW step and zeroing the gradients.
- **Collectives**: a gloo all-reduce among 2, 4 and 8 processes (up to ``--max-ranks``) of a
  few bytes (latency) and of a few MiB (bandwidth), read through the ring formula the cost
  model uses, so a group of ``n`` ranks gets its own link (``group_links``): with more ranks
  than cores, ranks wait for a core as well as for data. An all-gather and a reduce-scatter
  of the same bytes give their time over the ring formula's (gloo's are not rings).
- **Tensor parallelism**: the same layer split over 2, 4 and 8 ranks (up to ``--max-ranks``),
  each collective timed from its issue to its end; what the mean takes beyond its ring time
  is ``tp_calls`` by group size (the framework's own cost, the peers' skew and, in a group
  larger than the cores, the wait for members that are not running); the 2-way figure is
  also ``collective_overhead_s``. The same split layer with its collectives not issued,
  timed in turn with the whole layer, gives what a shard's compute costs over the price of
  a layer ``hidden / tp`` wide (``tp_compute``: its matmuls keep the full hidden size on
  one side, and run faster than that).
- **Cores** the ranks share, what share of their throughput 2, 4, ... times as many ranks
  keep (``core_efficiency``: a stack of layers per rank, so caches fill as a model's do), what
  a zero-bubble schedule's split backward costs over the whole one
  (``split_backward_factor``), and host memory (one rank's share of what is available).

Between nodes nothing can be measured from one machine: the ``cpu`` preset's link is kept.
The ranks' timing code is ``launch.calibration.ranks`` and ``launch.calibration.node``; this
module runs it and fits the device.
Later calls use the file with ``cost.device=calibrated`` (this host's default path,
``$XDG_CACHE_HOME/hybrid/device-<host>.json``, else under ``~/.cache/hybrid``) or
``cost.device=PATH``; the file records the host, the hybrid version and the time it was
measured, and another host or hybrid refuses it (``hybrid.planning.cost.device_files``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from dataclasses import replace
from pathlib import Path

from hybrid.planning.cost.device_files import write_device_file
from hybrid.planning.cost.devices import PRESETS, Device, Link, calibrated_path
from hybrid.planning.cost.collectives import ring_gather
from launch.launchers.fork_server import MEGATRON_IMPORT_WARNING
from launch.calibration.ranks import (BF16_SHAPE, LARGE_BYTES, SHAPES, SMALL_BYTES, TP_SHAPE,
                                    collective_times, compute_rates, thread_speedups,
                                    tp_call_seconds)
from launch.calibration.node import node_sharing

REFERENCE = (256, 1024)


CALIBRATED_ERROR = ("calibrated on this host; on this project's 2-core VMs the model's step "
                    "time is off by 10.9-12.7% on average (Spearman 0.915-0.985) over "
                    "bench/cost_vs_measured.py's 16 layouts, TP groups on 4-8 ranks sharing the "
                    "cores predicted up to 34% slow, pipelines up to 19% fast (docs/sweeps.md)")
CALIBRATED_ERROR_FRACTION = 0.12


def tp_overhead(figures: list[float], device: Device, ways: int = 2) -> list[float]:
    """``[wall, CPU]`` seconds per TP collective beyond its ring time, then the same for
    sequence parallelism's, from a ``ways``-way layer's mean collectives (``figures``: wall
    and CPU of each; ``TP_SHAPE``'s activations all-reduced, or all-gathered and
    reduce-scattered); the CPU part is work, the rest waiting."""
    from hybrid.planning.cost.collectives import ring_all_reduce

    h, rows = TP_SHAPE
    link = device.intra_for(ways)
    rings = (ring_all_reduce(rows * h * 4, ways, link),
             ring_gather(rows * h * 4, ways, link)
             * (device.all_gather_factor + device.reduce_scatter_factor) / 2)
    calls = []
    for (wall, cpu), ring in zip((figures[:2], figures[2:]), rings):
        calls += [max(0.0, wall - ring), min(max(0.0, wall - ring), cpu)]
    return calls


def fit_rate(rates: dict[tuple[int, int], float]) -> tuple[float, float, float]:
    """(flops, half_width, half_rows) of ``flops·h/(h+k)·r/(r+q)`` closest to ``rates`` in
    log space; a grid over ``k`` and ``q`` (the rate is then the geometric-mean fit), the
    whole grid at once (66,000 points)."""
    import numpy as np

    shapes = list(rates)
    h = np.array([s[0] for s in shapes], dtype=np.float64)
    r = np.array([s[1] for s in shapes], dtype=np.float64)
    k = np.arange(0, 2049, 8, dtype=np.float64)[:, None, None]
    q = np.arange(0, 4097, 16, dtype=np.float64)[None, :, None]
    logs = (np.log(np.array([rates[s] for s in shapes])) + np.log((h + k) / h)
            + np.log((r + q) / r))
    mean = logs.mean(axis=2)
    error = ((logs - mean[..., None]) ** 2).sum(axis=2)
    best_k, best_q = np.unravel_index(np.argmin(error), error.shape)  # the first, k then q
    return math.exp(mean[best_k, best_q]), float(k[best_k, 0, 0]), float(q[0, best_q, 0])


def fit_speedup(speedups: dict[int, float]) -> tuple[float, float]:
    """(speedup, half_rows) of ``1 + (speedup - 1) * rows / (rows + half_rows)`` through the
    measured speedups by rows (the fewest and the most)."""
    (few, at_few), (many, at_many) = sorted(speedups.items())[0], sorted(speedups.items())[-1]
    a, b = at_few - 1, at_many - 1
    if a <= 0 or b <= a or few == many:  # no threads gained, or no fall with fewer rows
        return max(at_many, 1.0), 0.0
    # b/a = many (few + q) / (few (many + q))  ->  solve for q
    q = few * many * (b - a) / (a * many - b * few)
    if q <= 0:
        return at_many, 0.0
    return 1 + b * (many + q) / many, q


def ring_link(n: int, small_s: float, large_s: float) -> Link:
    """The link whose ring all-reduce takes ``small_s`` for a few bytes and ``large_s`` for
    LARGE_BYTES: ``2(n-1)`` latencies, ``2(n-1)/n`` of the bytes over the bandwidth."""
    latency = small_s / (2 * (n - 1))
    moved = 2 * (n - 1) / n * (LARGE_BYTES - SMALL_BYTES)
    return Link(bandwidth=moved / max(large_s - small_s, 1e-9), latency=latency)


def calibrate(max_ranks: int, min_seconds: float, repeats: int) -> tuple[Device, dict]:
    """The measured device and the raw figures behind it."""
    from hybrid.testing import spawn

    cores = len(os.sched_getaffinity(0))
    loaded = spawn(compute_rates, cores, min_seconds, 1, timeout=600)
    by_shape = {shape: statistics.mean(r[f"{shape[0]}x{shape[1]}"] for r in loaded)
                for shape in SHAPES}
    flops, half_width, half_rows = fit_rate(by_shape)
    h, rows = BF16_SHAPE
    bf16_factor = h / (h + half_width) * rows / (rows + half_rows)
    thread_shapes = ((REFERENCE[0], 256), REFERENCE)
    speedups = spawn(thread_speedups, cores, min_seconds, thread_shapes, timeout=600)[0]
    thread_speedup, thread_half_rows = fit_speedup(speedups)
    links, raw_links, gather_factors = {}, {}, []
    n = 2
    while n <= max_ranks:
        times = spawn(collective_times, n, repeats, timeout=300)
        small, large, gather, scatter = (max(t[i] for t in times) for i in range(4))
        links[str(n)] = link = ring_link(n, small, large)
        ring = ring_gather(LARGE_BYTES, n, link)
        gather_factors.append((gather / ring, scatter / ring))
        raw_links[n] = {"small_s": small, "large_s": large, "all_gather_s": gather,
                        "reduce_scatter_s": scatter}
        n *= 2
    preset = PRESETS["cpu"]
    device = replace(
        preset, name=f"calibrated:{os.uname().nodename}",
        flops={"fp32": flops, "bf16": statistics.mean(r["bf16"] for r in loaded) / bf16_factor},
        matmul_half_width=half_width, matmul_half_rows=half_rows, cores=cores,
        thread_speedup=thread_speedup, thread_half_rows=thread_half_rows,
        all_gather_factor=statistics.mean(g for g, _ in gather_factors),
        reduce_scatter_factor=statistics.mean(r for _, r in gather_factors),
        optimizer_s_per_param=statistics.mean(r["optimizer_s_per_param"] for r in loaded),
        memory_bytes=_available_memory() // max(max_ranks, 1),
        intra=links.get("2", preset.intra), group_links=links, host=True,
        error=CALIBRATED_ERROR, error_fraction=CALIBRATED_ERROR_FRACTION)
    calls, shard_factors = _tp_calls(device, max_ranks, min_seconds)
    sharing = spawn(node_sharing, max(max_ranks, cores), 2 * min_seconds, cores,
                    timeout=300)[0]
    device = replace(device, collective_overhead_s=calls["2"][0], collective_cpu_s=calls["2"][1],
                     tp_calls=calls, tp_compute=shard_factors,
                     # more ranks than cores never gain throughput: above 1 is noise
                     core_efficiency={n: min(e, 1.0) for n, e in sharing["efficiency"].items()
                                      if int(n) > cores},
                     split_backward_factor=sharing["split_backward"])
    raw = {"layer_loaded": by_shape, "thread_speedups": speedups,
           "all_reduce": raw_links, "cores": cores}
    return device, raw


def _tp_calls(device: Device, max_ranks: int, min_seconds: float
              ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """By group size (2, 4, ... up to ``max_ranks``), the means over a split layer's ranks:
    ``tp_overhead`` of its collectives, and ``shard_factor`` of its compute."""
    from hybrid.testing import spawn

    calls, shards = {}, {}
    ways = 2
    while ways <= max_ranks:
        times = spawn(tp_call_seconds, ways, 2 * min_seconds, timeout=300)
        calls[str(ways)] = tp_overhead([statistics.mean(t[i] for t in times)
                                        for i in range(4)], device, ways)
        shards[str(ways)] = shard_factor(statistics.mean(t[4] for t in times), device, ways)
        ways *= 2
    return calls, shards


def shard_factor(ratio: float, device: Device, ways: int) -> float:
    """``Device.tp_compute`` for a ``ways``-way group from the shard's measured time over the
    whole layer's (``ratio``, at ``TP_SHAPE``): the shard's time over what the model prices
    it at, a ``1 / ways`` share of the layer's FLOPs at the rate of width ``hidden / ways``."""
    h, rows = TP_SHAPE
    priced = device.compute_rate("fp32", h, rows) / device.compute_rate("fp32", h / ways, rows)
    return ratio * ways / priced


def _available_memory() -> int:
    with open("/proc/meminfo") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    return int(fields["MemAvailable"].split()[0]) * 1024


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="hybrid-plan calibrate",
        description="Measure this machine for the cost model and write a device file "
                    "(launch/calibration/calibrate.py says what is measured and how).")
    parser.add_argument("--out", default=str(calibrated_path()),
                        help="device file to write (default: %(default)s)")
    parser.add_argument("--max-ranks", type=int, default=8,
                        help="largest gloo group to time (2, 4, ... up to this)")
    parser.add_argument("--seconds", type=float, default=0.3,
                        help="seconds per measured shape (longer: steadier figures)")
    parser.add_argument("--repeats", type=int, default=20, help="all-reduces per size")
    args = parser.parse_args(argv)
    if args.max_ranks < 2 or args.seconds <= 0 or args.repeats < 1:
        parser.error("--max-ranks must be >= 2, --seconds > 0 and --repeats >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # read by the workers' fork server as it imports megatron-core: no import noise on the console
    os.environ.setdefault("PYTHONWARNINGS", MEGATRON_IMPORT_WARNING)
    device, raw = calibrate(args.max_ranks, args.seconds, args.repeats)
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    write_device_file(device.to_dict(), out)  # with this host's record: another refuses it
    print(_summary(device, raw))
    default = str(out) == str(calibrated_path())
    print(f"wrote {out}; use it with cost.device={'calibrated' if default else out}")


def _summary(device: Device, raw: dict) -> str:
    fit = [f"{h}x{rows}: {rate / 1e9:.1f} (fit {device.compute_rate('fp32', h, rows) / 1e9:.1f})"
           for (h, rows), rate in raw["layer_loaded"].items()]
    lines = [f"cores: {device.cores}",
             "layer fp32 GFLOP/s by hidden x tokens, every core busy: " + ", ".join(fit),
             f"fitted: {device.flops['fp32'] / 1e9:.1f} GFLOP/s, half of it at width "
             f"{device.matmul_half_width:.0f} or {device.matmul_half_rows:.0f} tokens; bf16 "
             f"{device.flops['bf16'] / 1e9:.2f} GFLOP/s; {device.cores} threads in one rank: "
             f"x{device.thread_speedup:.2f}, half of the gain at "
             f"{device.thread_half_rows:.0f} tokens",
             f"all-gather / reduce-scatter over the ring formula: "
             f"x{device.all_gather_factor:.2f} / x{device.reduce_scatter_factor:.2f}",
             f"after the backward (norm, clip, AdamW, zero): "
             f"{device.optimizer_s_per_param * 1e9:.2f} ns per parameter",
             f"tensor parallelism, per collective beyond its ring time ({TP_SHAPE[0]} wide, "
             f"{TP_SHAPE[1]} tokens): " + ", ".join(
                 f"{n}-way {call[0] * 1e3:.2f} ms ({call[1] * 1e3:.2f} ms of it CPU work), "
                 f"with sequence parallelism {call[2] * 1e3:.2f} ms ({call[3] * 1e3:.2f})"
                 for n, call in device.tp_calls.items()),
             "a TP shard's compute over its price at width hidden / tp: " + ", ".join(
                 f"{n}-way x{f:.2f}" for n, f in device.tp_compute.items())]
    lines.append("ranks sharing the cores keep of their throughput: " + (", ".join(
        f"{n} ranks {e:.0%}" for n, e in device.core_efficiency.items()) or "(not measured)")
        + f"; a zero-bubble split backward (I + W) takes x{device.split_backward_factor:.2f} "
          f"of the whole one")
    for n, link in device.group_links.items():
        lines.append(f"gloo all-reduce, {n} ranks: latency {link.latency * 1e6:.0f} us per "
                     f"ring step, {link.bandwidth / 1e9:.2f} GB/s")
    return "\n".join(lines)
