"""bench/gpu_check.py's check (e), issue 40's replica balance on a machine with a core per
worker: what it reads from bench/dp_balance.py's output, and that it skips on fewer cores
(this machine's 2), fails above the bar or on differing losses, and passes under it. The
bench's own runs are test_bench_smoke's; the CUDA checks run on a GPU machine only."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"

RUN_LINE = ("{layout:<13} {mode:<8} median step   300.0 ms  shares ['even']  last loss {loss}  "
            "load 1.0")
RESULT_LINE = ("{layout}: median step even 300.0 ms, dynamic 200.0 ms; replica speeds measured "
               "[1.0, 0.5]; predicted 0.700 (balanced [8, 4]); cores busy even 0.50, dynamic "
               "0.80; cpu floor 0.500; ratio={ratio}")


@pytest.fixture
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_output(ratios: dict, loss_of_dynamic: str = "3.262022") -> str:
    lines = []
    for layout in ratios:
        lines.append(RUN_LINE.format(layout=layout, mode="even", loss="3.262022"))
        lines.append(RUN_LINE.format(layout=layout, mode="dynamic", loss=loss_of_dynamic))
    lines += [RESULT_LINE.format(layout=layout, ratio=r) for layout, r in ratios.items()]
    return "\n".join(lines)


def _outcome(gpu_check, monkeypatch, tmp_path, cores: int, stdout: str) -> str:
    monkeypatch.setattr(gpu_check.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(gpu_check.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout, ""))
    return gpu_check._run_check("e", lambda: gpu_check.replica_balance(tmp_path))


@pytest.mark.parametrize("cores, ratios, dynamic_loss, expected", [
    (2, {"dp2xpp2-1f1b": 0.7, "dp4-zero2": 0.7}, "3.262022", "SKIP"),
    (16, {"dp2xpp2-1f1b": 0.75, "dp4-zero2": 0.70}, "3.262022", "PASS"),
    (16, {"dp2xpp2-1f1b": 0.75, "dp4-zero2": 0.81}, "3.262022", "FAIL"),
    (16, {"dp2xpp2-1f1b": 0.75, "dp4-zero2": 0.70}, "3.262023", "FAIL"),
    (16, {"dp4-zero2": 0.70}, "3.262022", "FAIL"),  # a layout's result missing
], ids=["2-cores-skip", "under-the-bar", "above-the-bar", "losses-differ", "one-missing"])
def test_the_replica_balance_check_reads_the_bench(gpu_check, monkeypatch, tmp_path, capsys,
                                                   cores, ratios, dynamic_loss, expected):
    stdout = _bench_output(ratios, dynamic_loss)
    assert _outcome(gpu_check, monkeypatch, tmp_path, cores, stdout) == expected
    line = capsys.readouterr().out
    assert line.startswith(f"{expected} e: ")
    if expected == "SKIP":
        assert f"this machine has {cores}" in line
