"""Device and network presets for the cost model (pure: no torch).

A ``Device`` is what the cost model needs of a machine: the matrix-multiply rate one rank
achieves (not the datasheet peak), its memory, and the links between ranks inside a node and
across nodes (the bandwidth a collective achieves per rank, and a per-message latency).
``cost.device`` names a preset or a JSON file of the same fields (``Device.to_dict``).

The GPU presets are the datasheet peaks scaled by what large transformer runs achieve
(about 55% of dense bf16 peak; NVLink and InfiniBand at about 80% of line rate): good enough
to rank layouts, which is what the search needs; absolute times need the machine's own figures.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

GIB = 2**30
ACHIEVED_COMPUTE = 0.55
ACHIEVED_LINK = 0.8


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

    def to_dict(self) -> dict:
        return asdict(self)


def _gpu(name: str, bf16_peak: float, fp32_peak: float, memory_gib: float,
         nvlink_gbs: float, nic_gbit: float) -> Device:
    return Device(
        name=name,
        flops={"bf16": bf16_peak * ACHIEVED_COMPUTE, "fp32": fp32_peak * ACHIEVED_COMPUTE},
        memory_bytes=int(memory_gib * GIB),
        intra=Link(bandwidth=nvlink_gbs * 1e9 * ACHIEVED_LINK, latency=5e-6),
        inter=Link(bandwidth=nic_gbit / 8 * 1e9 * ACHIEVED_LINK, latency=10e-6))


PRESETS = {
    # bf16 dense peak, fp32 (TF32 tensor cores) peak, memory, NVLink per direction, NIC per GPU
    "a100-80gb": _gpu("a100-80gb", 312e12, 156e12, 80, 300, 200),
    "h100-80gb": _gpu("h100-80gb", 989e12, 494e12, 80, 450, 400),
    "h200": _gpu("h200", 989e12, 494e12, 141e9 / GIB, 450, 400),
    # One gloo rank with a core of its own on this project's 2-core machines: a 512x512
    # matmul on one thread runs at 62 GFLOP/s in fp32 and 1.2 in bf16 (no bf16 units); a
    # 2-rank all-reduce of 32-64 KiB takes about 0.5 ms (two ring steps); the bandwidth is a
    # round guess; memory is a 24 GiB host shared by 8 ranks; 10 Gb/s between hosts.
    "cpu": Device(name="cpu", flops={"fp32": 62e9, "bf16": 1.2e9}, memory_bytes=3 * GIB,
                  intra=Link(bandwidth=1e9, latency=250e-6),
                  inter=Link(bandwidth=10 / 8 * 1e9 * ACHIEVED_LINK, latency=100e-6)),
}


def load_device(name: str) -> Device:
    """A preset by name, or a JSON file of a ``Device``'s fields."""
    if name in PRESETS:
        return PRESETS[name]
    path = Path(name).expanduser()
    if not path.suffix == ".json" or not path.is_file():
        raise ValueError(f"cost.device={name} is neither a preset ({', '.join(PRESETS)}) nor a "
                         f"JSON file of a device's fields (hybrid/devices.py)")
    data = json.loads(path.read_text())
    return Device(name=data["name"], flops=dict(data["flops"]),
                  memory_bytes=int(data["memory_bytes"]), intra=Link(**data["intra"]),
                  inter=Link(**data["inter"]))


def with_inter_bandwidth(device: Device, gbit_per_s: float) -> Device:
    """The same device on a network of ``gbit_per_s`` between nodes (what-if studies)."""
    return replace(device, inter=Link(bandwidth=gbit_per_s / 8 * 1e9 * ACHIEVED_LINK,
                                      latency=device.inter.latency))
