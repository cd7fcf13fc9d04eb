"""Every script in bench/ runs, as a user runs it, at its smallest size.

A bench is run rarely and by hand, so a change elsewhere (a new argument of the loss, a new
default data source) breaks it silently until someone wants its figure. Each smoke run here
is a subprocess of ``.venv/bin/python bench/X.py`` with the arguments that make it smallest
(existing size arguments, or the script's ``--smoke``); it checks the exit status, that no
traceback was printed and that the comparison line, ``ratio=...`` (the benches print it last
on their result lines), came out. Its figures mean nothing and are not checked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
TIMEOUT_S = 240  # each run; on an idle machine the slowest takes about a tenth of it

SMOKE: dict[str, list[str]] = {  # {tmp}: the test's scratch directory (where runs are kept)
    "checkpoint_vs_dcp.py": ["--smoke"],
    "cost_vs_measured.py": ["--smoke", "--out", "{tmp}"],
    "cp_attention.py": ["--seq", "64", "--layers", "1", "--hidden", "32", "--heads", "2",
                        "--steps", "1"],
    "dp_compress_vs_torch.py": ["--warmup", "2", "--steps", "9", "--global-batch", "4",
                                "--micro-batch", "2", "--layers", "1", "--hidden", "32",
                                "--heads", "2", "--seq-len", "16"],
    "dp_options_loss.py": ["--smoke", "--out", "{tmp}"],
    "dp_balance.py": ["--smoke", "--out", "{tmp}"],
    "dp_vs_ddp.py": ["--steps", "2", "--microbatches", "1", "--layers", "1", "--hidden", "32",
                     "--heads", "2", "--seq-len", "16"],
    "generate_cache.py": ["--new", "8", "--repeats", "1"],
    "gpu_check.py": [],  # without CUDA: one line saying so (below)
    "moe_dispatch.py": ["--smoke"],
    "moe_stage_balance.py": ["--smoke", "--out", "{tmp}"],
    "hf_load_memory.py": ["--smoke"],
    "llama_vs_hf.py": ["--layers", "1", "--seq", "32", "--batch", "1", "--steps", "2",
                       "--threads", "1"],
    "partition_balance.py": ["--smoke", "--out", "{tmp}"],
    "pipeline_floor.py": ["--smoke"],
    "pp_balance.py": ["--smoke", "--out", "{tmp}"],
    "pp_move.py": ["--smoke"],
    "pipeline_vs_torch.py": ["--pp", "2", "--layers", "2", "--hidden", "32", "--heads", "2",
                             "--seq", "16", "--micro-batch", "1", "--microbatches", "2",
                             "--steps", "1", "--schedules", "1f1b"],
    "published_runs.py": [],
    "recompute_modes.py": ["--smoke", "--out", "{tmp}"],
    "schedule_ab.py": ["--smoke"],
    "search_speed.py": ["--model", "gpt3-125m", "--world", "8"],
    "tokenize_throughput.py": ["--smoke"],
    "tp_floor.py": ["--smoke"],
    "tp_vs_dtensor.py": ["--ranks", "2", "--layers", "1", "--hidden", "32", "--heads", "2",
                         "--seq", "16", "--batch", "2", "--steps", "1", "--no-sp"],
    "train_overhead.py": ["--smoke"],
    "watch_overhead.py": ["--smoke"],
    "zero3_vs_fsdp2.py": ["--ranks", "2", "--steps", "2", "--microbatches", "1", "--layers",
                          "1", "--hidden", "32", "--heads", "2", "--seq-len", "16"],
}


def run_bench(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The script as a user runs it, from a scratch directory (nothing lands in the repo).
    In a session of its own: past the timeout its whole group goes, ranks and
    ``hybrid-train`` runs included, so no process outlives a failed test."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(BENCH / script), *(a.format(tmp=cwd) for a in args)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{script} ran past {TIMEOUT_S} s:\n{(out + err)[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the script left behind
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_every_bench_script_has_a_smoke_run():
    scripts = {p.name for p in BENCH.glob("*.py")}
    assert scripts == set(SMOKE), (
        f"bench/ scripts without a smoke run: {sorted(scripts - set(SMOKE))}; entries for "
        f"scripts that are gone: {sorted(set(SMOKE) - scripts)}; add each new script to SMOKE "
        f"with the arguments that make it smallest")


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("script", sorted(s for s in SMOKE if s != "gpu_check.py"))
def test_bench_runs_at_its_smallest_size(script, tmp_path):
    done = run_bench(script, SMOKE[script], tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{output[-3000:]}"
    assert "Traceback" not in output, output[-3000:]
    results = [line for line in done.stdout.splitlines() if line.strip()]
    assert results and "ratio=" in results[-1], f"no ratio= line last:\n{done.stdout[-2000:]}"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_gpu_check_without_cuda_ends_in_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: bench/gpu_check.py runs its checks (minutes on a GPU)")
    done = run_bench("gpu_check.py", SMOKE["gpu_check.py"], tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()]
    assert done.stdout.startswith("gpu_check: CUDA is not available here")
    assert not any(tmp_path.iterdir())
