"""Device and network presets for the cost model (pure: no torch).

A ``Device`` is what the cost model needs of a machine: the matrix-multiply rate one rank
achieves (not the datasheet peak), its memory, and the links between ranks inside a node and
across nodes (the bandwidth a collective achieves per rank, and a per-message latency).
``cost.device`` names a preset or a JSON file of the same fields (``Device.to_dict``).

The GPU presets are datasheet figures scaled by what published micro-benchmarks achieve, each
constant below saying where it comes from: large multiplies at 80% of the dense peak, a fixed
cost per kernel (what makes small multiplies less efficient), memory-bound kernels at 90% of
the HBM bandwidth (``hybrid.planning.cost.memory_bound``), links at 80% of line rate
(NVLink, and a 200/400 Gb/s NIC per GPU). Nothing is fitted to a training run: the A100
preset reproduces the iteration times Korthikanti et al. 2022 published for 22B-1T models
within 10% (``hybrid/planning/cost/published.py``); the H100 and H200 presets assume the
same fractions. ``hybrid-plan calibrate`` measures a machine instead.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from hybrid.planning.cost.device_files import (  # noqa: F401 (calibrated_path: callers)
    DeviceError, calibrated_path, read_device_file,
)

GIB = 2**30
ACHIEVED_COMPUTE = 0.8
"""Of the dense peak, what large multiplies achieve: A100 bf16 GEMMs reach 80-86% of 312
TFLOP/s (NVIDIA's Matrix Multiplication Background guide; Bekman's Machine Learning
Engineering, "maximum achievable matmul FLOPS": 268 TFLOP/s on A100 SXM)."""
ACHIEVED_LINK = 0.8
"""NCCL's bus bandwidth over the line rate: about 230 of 300 GB/s NVLink on a DGX A100, and
about 20 of 25 GB/s per 200 Gb/s HDR InfiniBand port (nccl-tests)."""
ACHIEVED_MEMORY = 0.9
"""Of the HBM bandwidth, what large element-wise kernels achieve (Isaev et al. 2023,
Calculon's A100-80GB system file: 90% from 100 MB up)."""
KERNEL_S = 3e-6
"""Fixed cost of a kernel on an A100: Calculon's A100 GEMM efficiency by size (60%, 90%, 95%
of the peak at 1, 16, 128 GFLOP) is a large multiply's rate plus 2.3-3.6 us per GEMM; CUDA's
launch latency is of the same order."""

COLLECTIVE_SMS = 16
"""SMs a running NCCL collective holds on a node of 8 GPUs and 8 NICs: one thread block a
channel, each on an SM it shares with no other kernel, 16 on a DGX A100 (NCCL's maintainers,
NVIDIA/nccl#689). Lee et al. 2025 ("Characterizing Compute-Communication Overlap in
GPU-Accelerated Distributed Deep Learning") measure compute overlapped with communication
18.9% slower on average on A100 and H100; 16 of an A100's 108 SMs is 14.8%."""


@dataclass(frozen=True)
class Link:
    bandwidth: float
    """Bytes per second one rank sends (and receives) in a ring collective."""
    latency: float
    """Seconds per message (per ring step)."""


@dataclass(frozen=True)
class Device:
    name: str
    flops: dict
    """Achieved dense matmul FLOP/s by precision (``fp32``, ``bf16``)."""
    memory_bytes: int
    """What one rank may use (a GPU's memory; on CPU, one rank's share of the host)."""
    intra: Link
    """Between ranks of one node (NVLink; shared memory for gloo on CPU)."""
    inter: Link
    """Between nodes (InfiniBand / Ethernet), per rank."""
    matmul_half_width: float = 0.0
    """Narrow work runs slower: a layer whose weights are ``k`` wide per rank achieves
    ``flops * k / (k + matmul_half_width)`` (0: every width at ``flops``)."""
    matmul_half_rows: float = 0.0
    """Likewise for few tokens per micro-batch: ``rows / (rows + matmul_half_rows)``."""
    memory_bandwidth: float = 0.0
    """Bytes per second memory-bound kernels achieve (``hybrid.planning.cost.memory_bound``:
    norms, activations, dropout, residual adds, gradient accumulation); 0: not priced apart
    (a calibrated CPU's layer timing already holds them)."""
    kernel_s: float = 0.0
    """Fixed seconds each kernel costs beyond its work (launch, ramp-up, tail): what makes a
    small multiply less efficient than a large one."""
    unfused_attention: bool = False
    """The software writes the attention scores out (softmax and dropout as their own kernels
    over ``b·a·s²`` scores, as Megatron-LM did in 2021-2022); hybrid's layer runs a fused
    kernel that keeps none."""
    blocking_p2p: bool = False
    """A pipeline rank waits for each exchange of activations or gradients before it goes on
    (Megatron-LM 2021 synchronised the device after every batched send and receive): the
    message's time is part of every chunk's forward and backward, so interleaving, with
    ``vpp`` times the exchanges, pays for each."""
    dp_after_backward: bool = False
    """The software reduces gradients only after the pipeline's last backward (Megatron-LM's
    ``local`` DDP), so none of the reduction hides behind it."""
    dp_one_collective: bool = False
    """The software reduces a rank's gradients in one collective a step (Megatron-LM's
    ``local`` DDP: its contiguous buffer), not in buckets: the ring's latency is paid once."""
    p2p_scatter_gather: bool = False
    """Between nodes, each TP rank sends ``1 / tp`` of an activation over its own NIC and the
    receiving node gathers it over NVLink (Narayanan et al. 2021, section 4.1)."""
    p2p_meta_messages: int = 0
    """Small blocking messages sent before every activation or gradient (DeepSpeed's
    pipeline engine: each partitioned tensor's shape, its own ``p2p.send``): a latency each."""
    p2p_restore_gather: bool = False
    """The sender's backward gathers back the output it sent partitioned (DeepSpeed's
    ``_exec_backward_pass``, ``part_output.full()``): one more gather a backward exchange."""
    tied_after_backward: bool = False
    """The tied embedding's gradient is all-reduced between the first and last stage after
    the last backward, nothing beside it (DeepSpeed's ``_exec_reduce_tied_grads``)."""
    p2p_exchanges_in_series: bool = False
    """A rank's two exchanges with one neighbour run one after the other, not together
    (DeepSpeed's blocking ``p2p.send`` and ``p2p.recv``, one pair communicator each)."""
    grad_accumulate_bytes: float = 0.0
    """Bytes a parameter each micro-batch's gradient accumulation moves (0: fp32 main
    gradients, ``memory_bound.ACCUMULATE_BYTES_PER_PARAM``; 16-bit ``.grad``s added in place: 6)."""
    p2p_gather_passes: int = 0
    """Memory passes over the whole activation each gather of a partitioned message makes
    beside the gather itself (DeepSpeed's ``PartitionedTensor.full``: 5)."""
    collective_sm_share: float = 0.0
    """The share of the SMs a running collective holds, that the multiplies beside a
    reduction the backward hides lose while it runs (``COLLECTIVE_SMS``); 0: not priced."""
    optimizer_s_per_param: float = 0.0
    """Seconds of the AdamW step per parameter a rank updates (not overlapped)."""
    cores: int = 0
    """CPU cores the ranks of one node share (0: each rank has a device of its own). A rank
    gets ``cores // ranks`` threads (``hybrid-train``'s default); with more ranks than cores
    the node cannot finish before its cores have done every rank's work."""
    thread_speedup: float = 1.0
    """How much faster one rank computes with every core's thread than with one, on wide
    work; less on few tokens: ``1 + (thread_speedup - 1) * rows / (rows + thread_half_rows)``."""
    thread_half_rows: float = 0.0
    core_efficiency: dict = field(default_factory=dict)
    """By ranks on the node (``"4"``, ``"8"``, ...; more than ``cores``): what share of the
    cores' throughput with one rank per core they keep (context switches, caches), measured
    by ``hybrid-plan calibrate``; other counts use the nearest measured one (none: 1)."""
    split_backward_factor: float = 1.0
    """A backward split into ``I`` and a deferred ``W`` (zero-bubble schedules) over the
    whole backward's time (on a CPU's small caches ``W`` reads cold data)."""
    collective_overhead_s: float = 0.0
    """Seconds each tensor-parallel collective costs beyond its ring time: the framework's
    own work per call (measured by ``hybrid-plan calibrate`` on a real 2-way TP layer)."""
    collective_cpu_s: float = 0.0
    """Of that, CPU work (the rest is waiting, which other ranks can fill on shared cores)."""
    tp_calls: dict = field(default_factory=dict)
    """Measured ``[wall, cpu]`` seconds per TP collective beyond its ring time, then the same
    for sequence parallelism's all-gathers and reduce-scatters, by TP group size inside one
    node (``"2"``, ``"4"``, ...), from ``hybrid-plan calibrate``: a group larger than the
    node's cores waits at every call for members that are not running, which no per-call
    figure of a smaller group shows. Other sizes use the nearest measured one; empty:
    ``collective_overhead_s`` and ``collective_cpu_s``."""
    tp_compute: dict = field(default_factory=dict)
    """By TP group size (``"2"``, ``"4"``, ...): one rank's shard of a layer, timed, over
    what ``compute_rate`` at width ``hidden / tp`` prices it at, from ``hybrid-plan
    calibrate``. A shard's matmuls keep the full hidden size on one side, so they run faster
    than a layer ``hidden / tp`` wide (on this project's 2-core machine, at 0.82-0.87,
    0.69-0.82 and 0.56-0.73 of that price 2-, 4- and 8-way). Other sizes use the nearest
    measured one; none: 1 (the GPU presets' fits price the narrow width)."""
    all_gather_factor: float = 1.0
    """An all-gather's time over the ring formula's (gloo's is not a ring)."""
    reduce_scatter_factor: float = 1.0
    """A reduce-scatter's time over the ring formula's."""
    group_links: dict = field(default_factory=dict)
    """Measured links inside a node by group size (``"2"``, ``"4"``, ...), from
    ``hybrid-plan calibrate``; other sizes use the nearest measured one, else ``intra``."""
    peak: dict = field(default_factory=dict)
    """Datasheet dense FLOP/s by precision, what MFU divides by; absent (a CPU, a calibrated
    machine): the achieved ``flops``, the best rate known."""
    host: bool = False
    """A CPU machine whose ranks share the host's memory (``memory_bytes`` is one rank's
    share); else each rank has a device of its own with ``memory_bytes``."""
    error: str = ""
    """What is known of the cost model's error on this device, said beside every prediction
    (empty: not measured)."""
    error_fraction: float = 0.0
    """The model's mean |error| of step time measured on this device (0: not measured):
    layouts predicted closer than this to the best cannot be told apart."""
    file: str = ""
    """The device file it was read from, named beside every prediction (empty: a preset)."""
    file_time: float = 0.0
    """When that file's figures were measured (epoch seconds), for its age."""

    def peak_flops(self, precision: str) -> float:
        return self.peak.get(precision) or self.flops[precision]

    def compute_rate(self, precision: str, width: float, rows: float,
                     threads: int = 1) -> float:
        """FLOP/s of layer work ``width`` wide per rank on ``rows`` tokens per micro-batch."""
        rate = (self.flops[precision] * width / (width + self.matmul_half_width)
                * rows / (rows + self.matmul_half_rows))
        if self.cores > 1 and threads > 1:  # between one thread and every core's
            speedup = (self.thread_speedup - 1) * rows / (rows + self.thread_half_rows)
            rate *= 1 + speedup * (min(threads, self.cores) - 1) / (self.cores - 1)
        return rate

    def sharing_efficiency(self, ranks: int) -> float:
        """What share of the cores' throughput ``ranks`` ranks on one node keep."""
        if not self.core_efficiency or ranks <= self.cores:
            return 1.0
        return float(_nearest(self.core_efficiency, ranks))

    def tp_call(self, group_size: int, sequence_parallel: bool = False
                ) -> tuple[float, float]:
        """(wall, CPU) seconds per TP collective of a ``group_size``-way group, beyond its ring
        time (see ``tp_calls``)."""
        if not self.tp_calls:
            return self.collective_overhead_s, self.collective_cpu_s
        measured = _nearest(self.tp_calls, group_size)
        wall, cpu = measured[2:4] if sequence_parallel and len(measured) > 2 else measured[:2]
        return float(wall), float(cpu)

    def tp_compute_factor(self, group_size: int) -> float:
        """What a ``group_size``-way TP shard's layer compute costs over its priced time."""
        if group_size <= 1 or not self.tp_compute:
            return 1.0
        return float(_nearest(self.tp_compute, group_size))

    def intra_for(self, group_size: int) -> Link:
        """The link a collective among ``group_size`` ranks of one node runs at."""
        if not self.group_links:
            return self.intra
        return _nearest(self.group_links, group_size)

    def to_dict(self) -> dict:
        return asdict(self)


def _nearest(by_size: dict, size: int):
    """The entry of a table keyed by group size (``"2"``, ``"4"``, ...) nearest ``size``
    (the smaller on a tie)."""
    return by_size[min(by_size, key=lambda n: (abs(int(n) - size), int(n)))]


ADAMW_BYTES_PER_PARAM = 28
"""Read weight, gradient and two moments, write weight and moments: 7 fp32 values."""


UNCALIBRATED_CPU = ("uncalibrated round figures, not this machine: a sweep here ran 17x slower "
                    "than they predict; run hybrid-plan calibrate, then cost.device=calibrated")
A100_ERROR_FRACTION = 0.11
A100_ERROR = ("published A100 figures, nothing fitted; Korthikanti 2022's 8 runs within 10%; on "
              "Narayanan 2021's 10 held-out runs mean |error| 11%, worst +18% on the smallest "
              "(docs/sweeps.md)")
UNCHECKED_GPU = ("not checked against measured runs: the A100 preset's achieved fractions on "
                 "this device's datasheet")


def _gpu(name: str, bf16_peak: float, fp32_peak: float, memory_gib: float,
         nvlink_gbs: float, nic_gbit: float, hbm_tbs: float, sms: int,
         error: str = UNCHECKED_GPU, error_fraction: float = 0.0) -> Device:
    return Device(
        name=name,
        flops={"bf16": bf16_peak * ACHIEVED_COMPUTE, "fp32": fp32_peak * ACHIEVED_COMPUTE},
        peak={"bf16": bf16_peak, "fp32": fp32_peak},
        memory_bytes=int(memory_gib * GIB),
        intra=Link(bandwidth=nvlink_gbs * 1e9 * ACHIEVED_LINK, latency=5e-6),
        inter=Link(bandwidth=nic_gbit / 8 * 1e9 * ACHIEVED_LINK, latency=10e-6),
        memory_bandwidth=hbm_tbs * 1e12 * ACHIEVED_MEMORY, kernel_s=KERNEL_S,
        optimizer_s_per_param=ADAMW_BYTES_PER_PARAM / (hbm_tbs * 1e12 * ACHIEVED_MEMORY),
        collective_sm_share=COLLECTIVE_SMS / sms, error=error, error_fraction=error_fraction)


PRESETS = {
    # bf16 dense peak, fp32 (TF32) peak, memory, NVLink per direction, NIC per GPU, HBM
    # TB/s, SMs
    "a100-80gb": _gpu("a100-80gb", 312e12, 156e12, 80, 300, 200, 2.039, 108, A100_ERROR,
                      A100_ERROR_FRACTION),
    "h100-80gb": _gpu("h100-80gb", 989e12, 494e12, 80, 450, 400, 3.35, 132),
    "h200": _gpu("h200", 989e12, 494e12, 141e9 / GIB, 450, 400, 4.8, 132),
    # One gloo rank with a core of its own on this project's 2-core machines: a 512x512
    # matmul on one thread runs at 62 GFLOP/s in fp32 and 1.2 in bf16 (no bf16 units); a
    # 2-rank all-reduce of 32-64 KiB takes about 0.5 ms (two ring steps); the bandwidth is a
    # round guess; memory is a 24 GiB host shared by 8 ranks; 10 Gb/s between hosts.
    "cpu": Device(name="cpu", flops={"fp32": 62e9, "bf16": 1.2e9}, memory_bytes=3 * GIB,
                  intra=Link(bandwidth=1e9, latency=250e-6),
                  inter=Link(bandwidth=10 / 8 * 1e9 * ACHIEVED_LINK, latency=100e-6),
                  host=True, error=UNCALIBRATED_CPU),
}


def load_device(name: str) -> Device:
    """A preset by name, ``calibrated`` (this host's ``hybrid-plan calibrate`` file), or a JSON
    file of a ``Device``'s fields."""
    if name in PRESETS:
        return PRESETS[name]
    if name == "calibrated":
        path = calibrated_path()
        if not path.is_file():
            raise DeviceError(f"cost.device=calibrated but {path} does not exist; run "
                              f"hybrid-plan calibrate first")
    else:
        path = Path(name).expanduser()
    if not path.suffix == ".json" or not path.is_file():
        raise DeviceError(f"cost.device={name} is neither a preset ({', '.join(PRESETS)}, "
                          f"calibrated) nor a JSON file of a device's fields "
                          f"(hybrid/planning/cost/devices.py)")
    data, source = read_device_file(path, f"cost.device={name}")
    device = device_from_dict(data, f"cost.device={name}")
    return replace(device, file=source.path, file_time=source.measured_at)


_FROM_JSON = {"float": float, "int": int, "bool": bool, "str": str, "dict": dict,
              "Link": lambda link: Link(**link)}
"""How a device file's value becomes a field's, by the field's annotation (a string: the
module's annotations are postponed); ``tests/test_calibrate.py`` checks every field has one."""


def device_from_dict(data: dict, source: str = "the device file") -> Device:
    """A ``Device`` from ``Device.to_dict``'s fields (one absent: its default; ``host``:
    whether the file gives cores); a field it does not know, or a required one missing, is
    refused with the fix."""
    known = {f.name: f for f in fields(Device)}
    unknown = sorted(set(data) - set(known))
    missing = [name for name, f in known.items()
               if f.default is f.default_factory is MISSING and name not in data]
    if unknown or missing:
        raise DeviceError(f"{source} has unknown fields {unknown} and lacks {missing}; write "
                          f"it as Device.to_dict does, or run hybrid-plan calibrate again")
    values = {name: _FROM_JSON[known[name].type](value) for name, value in data.items()}
    values["group_links"] = {n: Link(**link) for n, link in data.get("group_links", {}).items()}
    values.setdefault("host", int(data.get("cores", 0)) > 0)
    return Device(**values)


def with_inter_bandwidth(device: Device, gbit_per_s: float) -> Device:
    """The same device on a network of ``gbit_per_s`` between nodes (what-if studies)."""
    return replace(device, inter=Link(bandwidth=gbit_per_s / 8 * 1e9 * ACHIEVED_LINK,
                                      latency=device.inter.latency))


def device_for(cost) -> Device:
    """The device a config's ``cost`` section prices on (``cost.inter_node_gbit`` applied)."""
    device = load_device(cost.device)
    if cost.inter_node_gbit is not None:
        if not cost.inter_node_gbit > 0:
            raise DeviceError(f"cost.inter_node_gbit={cost.inter_node_gbit} must be > 0 (Gb/s)")
        device = with_inter_bandwidth(device, cost.inter_node_gbit)
    return device
