"""``hybrid-plan calibrate``: its fits recover known figures, and the command writes a device
file that ``cost.device`` then uses."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hybrid.planning.cost.devices import (
    _FROM_JSON, PRESETS, Device, DeviceError, device_from_dict, load_device,
)
from launch.calibration.calibrate import LARGE_BYTES, SHAPES, fit_rate, ring_link

PLAN = str(Path(sys.executable).parent / "hybrid-plan")


def test_the_rate_fit_recovers_rate_and_half_sizes():
    flops, width, rows = 80e9, 200.0, 512.0
    rates = {(h, r): flops * h / (h + width) * r / (r + rows) for h, r in SHAPES}
    assert fit_rate(rates) == pytest.approx((flops, width, rows), rel=1e-6)
    flat = {shape: 50e9 for shape in SHAPES}  # no size effect seen: no half sizes
    assert fit_rate(flat) == pytest.approx((50e9, 0.0, 0.0))


def test_the_ring_link_inverts_the_ring_all_reduce_formula():
    from hybrid.planning.cost.collectives import ring_all_reduce

    link = ring_link(4, small_s=6e-4, large_s=0.02)
    assert ring_all_reduce(8, 4, link) == pytest.approx(6e-4, rel=1e-3)
    assert ring_all_reduce(LARGE_BYTES, 4, link) == pytest.approx(0.02, rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_calibrate_writes_a_device_that_plans_use(tmp_path):
    out = tmp_path / "device.json"
    done = subprocess.run([PLAN, "calibrate", "--out", str(out), "--max-ranks", "2",
                           "--seconds", "0.01", "--repeats", "3"],
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"use it with cost.device={out}" in done.stdout
    assert "Transformer Engine" not in done.stderr  # megatron-core's import warning
    device = load_device(str(out))
    assert device.flops["fp32"] > 1e8 and device.cores >= 1
    assert device.optimizer_s_per_param > 0 and device.thread_speedup > 0
    assert set(device.group_links) == {"2"} and device.intra_for(8) == device.group_links["2"]
    # per TP call (and SP's) by group size; no crowding measured with one rank a core
    assert set(device.tp_calls) == {"2"} and len(device.tp_calls["2"]) == 4
    assert device.tp_call(2) == (device.collective_overhead_s, device.collective_cpu_s)
    assert set(device.tp_compute) == {"2"} and 0.2 < device.tp_compute["2"] < 5
    assert device.core_efficiency == {} and device.split_backward_factor > 0
    assert json.loads(out.read_text())["name"].startswith("calibrated:")
    planned = subprocess.run([PLAN, "model=tiny", "parallel.tp=2", f"cost.device={out}"],
                             capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "predicted on calibrated:" in planned.stdout


def test_a_device_file_round_trips_and_refuses_a_field_it_does_not_know(tmp_path):
    from dataclasses import fields

    assert all(f.type in _FROM_JSON for f in fields(Device))  # every field can be read back
    for device in PRESETS.values():
        assert device_from_dict(json.loads(json.dumps(device.to_dict()))) == device
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps(PRESETS["cpu"].to_dict() | {"memory_bandwith": 1e12}))
    with pytest.raises(DeviceError, match=r"unknown fields \['memory_bandwith'\] and lacks \[\]"):
        load_device(str(typo))
    bare = {k: v for k, v in PRESETS["cpu"].to_dict().items() if k != "flops"}
    with pytest.raises(DeviceError, match=r"lacks \['flops'\]"):
        device_from_dict(bare)


def test_a_tp_call_is_its_measured_mean_less_its_ring_time():
    from hybrid.planning.cost.collectives import ring_all_reduce, ring_gather
    from launch.calibration.calibrate import tp_overhead
    from launch.calibration.ranks import TP_SHAPE

    device = PRESETS["cpu"]
    activation = TP_SHAPE[0] * TP_SHAPE[1] * 4
    ring = ring_all_reduce(activation, 4, device.intra)
    sp_ring = ring_gather(activation, 4, device.intra)  # both factors 1 on the preset
    wall, cpu, sp_wall, sp_cpu = tp_overhead([ring + 3e-3, 1e-3, sp_ring + 2e-3, 5e-3],
                                             device, ways=4)
    assert (wall, cpu) == pytest.approx((3e-3, 1e-3))
    assert (sp_wall, sp_cpu) == pytest.approx((2e-3, 2e-3))  # CPU never above the wall
    assert tp_overhead([ring / 2, 0.0, 0.0, 0.0], device, ways=4)[0] == 0.0


def test_a_tp_shards_factor_is_its_time_over_its_price():
    from launch.calibration.calibrate import shard_factor
    from launch.calibration.ranks import TP_SHAPE

    flat = replace(PRESETS["cpu"], matmul_half_width=0.0)
    assert shard_factor(0.5, flat, 2) == pytest.approx(1.0)  # half the time, as priced
    narrow = replace(flat, matmul_half_width=TP_SHAPE[0])  # priced: 1/2 at 1/1.5 the rate
    assert shard_factor(0.5, narrow, 2) == pytest.approx(1 / 1.5)
    assert shard_factor(0.3, narrow, 4) == pytest.approx(0.3 * 4 / (0.5 / 0.2))


def test_calibrate_refuses_bad_flags_in_one_line():
    done = subprocess.run([PLAN, "calibrate", "--max-ranks", "1"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--max-ranks must be >= 2" in done.stderr


def _timed_tp_layer(rank, world, late_s):
    """``calibrate``'s TP timing with rank 1 starting ``late_s`` after rank 0: each rank's
    clock passes the time bound at a different run."""
    import time

    import torch.distributed as dist

    from hybrid.comm import Group
    from launch.calibration.ranks import TP_SHAPE, layer_seconds

    every = Group(dist.group.WORLD, list(range(world)), "tp", "gloo")
    if rank == 1:
        time.sleep(late_s)  # the disturbance itself: a rank made slow on purpose
    return layer_seconds(*TP_SHAPE, "fp32", 0.3, every)


@pytest.mark.timeout(120)
def test_ranks_timing_a_collective_layer_agree_on_how_often_so_none_hangs():
    """#30's hang: with each rank bounding its own timing loop by its own clock, the late
    rank ran the TP layer once more than its peer and waited forever in its all-reduce."""
    from hybrid.testing import spawn

    seconds = spawn(_timed_tp_layer, 2, 0.5, timeout=90)
    assert all(s > 0 for s in seconds)
