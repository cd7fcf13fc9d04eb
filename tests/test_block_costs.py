"""partition=measured: the calibration file, the plan's use of measured costs, the timer."""

import json

import pytest

from hybrid.planning.config import Config
from hybrid.planning.job import plan_job
from hybrid.planning.layout import LayoutError
from hybrid.planning.cost.block_costs import (
    calibration_record, partition_basis, predicted_block_costs, read_calibration,
    known_block_costs, write_calibration,
)


def measured_cfg(**parallel) -> Config:
    cfg = Config()
    cfg.model.layers, cfg.model.vocab = 6, 16384
    cfg.parallel.pp, cfg.parallel.partition = 2, "measured"
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def test_a_heavy_measured_head_moves_layers_to_the_first_stage():
    cfg = measured_cfg(block_costs=[0.001] + [0.01] * 6 + [0.05])  # the head weighs 5 layers
    assert [st.blocks for st in plan_job(cfg).stages] == [range(0, 6), range(6, 8)]
    cfg.parallel.partition, cfg.parallel.block_costs = "uniform", None
    assert [st.blocks for st in plan_job(cfg).stages] == [range(0, 4), range(4, 8)]


def test_until_measured_the_cost_models_flops_stand_in():
    cfg = measured_cfg()
    costs = predicted_block_costs(cfg)
    assert len(costs) == 8 and costs[0] == 0 and costs[-1] > costs[1] == costs[6] > 0
    plan = plan_job(cfg)
    assert partition_basis("measured", plan.costs_measured).startswith("predicted FLOPs")
    cfg.parallel.block_costs = costs
    plan = plan_job(cfg)
    assert partition_basis("measured", plan.costs_measured) == "measured seconds"


def test_a_calibration_file_round_trips_and_splits_the_plan_not_the_config(tmp_path):
    cfg = measured_cfg(partition_file=str(tmp_path / "costs.json"))
    record = calibration_record(cfg, [0.1] + [0.2] * 6 + [0.3], [0.2] + [0.4] * 6 + [0.9],
                                ranks=2, how="test")
    assert record["blocks"][0] == "embedding" and record["blocks"][-1] == "head"
    assert record["cost_s"] == pytest.approx([0.3] + [0.6] * 6 + [1.2])
    assert known_block_costs(cfg) is None  # no file yet: the ranks will measure
    assert not plan_job(cfg).costs_measured
    write_calibration(cfg.parallel.partition_file, record)
    costs = known_block_costs(cfg)
    assert costs == pytest.approx(record["cost_s"])
    plan = plan_job(cfg, block_costs=costs)
    assert plan.costs_measured and plan.block_costs == pytest.approx(record["cost_s"])
    assert cfg.parallel.block_costs is None  # nothing written back into the config


def test_a_file_measured_for_another_job_is_refused_in_one_line(tmp_path):
    path = tmp_path / "costs.json"
    other = measured_cfg()
    other.train.micro_batch = 4
    write_calibration(path, calibration_record(other, [0.1] * 8, [0.2] * 8, ranks=2, how=""))
    with pytest.raises(LayoutError, match=r"measured for another job: micro_batch=4 \(now 2\)"
                       r"; delete it") as caught:
        read_calibration(path, measured_cfg())
    assert "\n" not in str(caught.value)
    path.write_text(json.dumps({"cost_s": [1, 2]}))
    with pytest.raises(LayoutError, match="cannot be read as block costs"):
        read_calibration(path, measured_cfg())


def test_the_timer_returns_the_median_forward_and_backward():
    torch = pytest.importorskip("torch")
    from hybrid.pipeline.calibrate import forward_backward_seconds

    layer = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    calls = []

    def forward():
        calls.append(1)
        return layer(x).sum()

    f, b = forward_backward_seconds(forward, torch.device("cpu"), runs=3)
    assert len(calls) == 4 and f > 0 and b > 0  # one warm-up, three timed
    f, b = forward_backward_seconds(lambda: layer(x), torch.device("cpu"), runs=1,
                                    grad=torch.ones(32, 64), precision="bf16")
    assert f > 0 and b > 0


def test_the_gpu_check_says_in_one_line_that_there_is_no_gpu_here():
    import subprocess
    import sys
    from pathlib import Path

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: bench/gpu_check.py would run its checks")
    script = Path(__file__).parents[1] / "bench" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.count("\n") == 1
    assert done.stdout.startswith("gpu_check: CUDA is not available here")
