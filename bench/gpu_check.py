"""The CUDA path checked on a GPU machine, in one go (a few minutes on one H200):

(a) the 1-process model's loss and gradients on CUDA against the CPU reference, same seed and
    data, fp32 and bf16;
(b) ``hybrid-train`` on CUDA (the trainer, the pipeline runtime's single-process path and the
    timeline, whose spans wait for the GPU) against the same run on the CPU;
(c) single-GPU tokens/s and model-FLOPs utilisation of a GPT-2-sized model (124M: 12 layers,
    h=768, 12 heads, seq 1024, vocab 50257) in bf16, against the H200's bf16 dense peak;
(d) with 2 or more GPUs, NCCL: dp2, tp2 and pp2 (measured partition, timeline) against (b)'s
    1-process CUDA run;
(e) with 8 or more CPU cores (a core per worker, which this project's 2-core machine lacks):
    issue 40's replica balance, ``bench/dp_balance.py`` on dp2 x pp2 1F1B and dp4 ZeRO-2 with
    replica 1 at half speed (20/20 ms), gloo on the host's cores: dynamic's median step at
    most 0.8 of even's, and the same last loss.

One PASS/FAIL/SKIP line per check, then a summary; exits 1 if a check failed. Synthetic data,
nothing downloaded. Without CUDA it exits at once with one line (status 0: nothing to check).

    .venv/bin/python bench/gpu_check.py

Tolerances. fp32: loss relative 1e-5 and each gradient's relative L2 error 1e-4 (TF32 is off
for matmuls by torch's default; only summation order differs); the trainer's losses within
DESIGN's 1e-5 at step 1 and 1e-4 after. bf16: loss relative 2e-2 and gradient relative error
5e-2, since CPU and CUDA kernels round bf16 products and sums differently.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

BIN = Path(sys.executable).parent
TINY = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 512, "seq_len": 64}
TINY_RUN = ["model=tiny", "model.layers=4", "train.global_batch=8", "train.micro_batch=2",
            "train.log_every=100", "seed=7", "optim.warmup_steps=0"]
GPT2 = ["model=tiny", "model.layers=12", "model.hidden=768", "model.heads=12",
        "model.seq_len=1024", "model.vocab=50257", "model.tie_embeddings=true"]
TOLERANCE = {"fp32": (1e-5, 1e-4), "bf16": (2e-2, 5e-2)}  # (loss, gradient), relative
RUN_TIMEOUT_S = 240
BALANCE_CORES = 8
"""(e) needs a core per worker and room for the agent: on fewer, the workers share cores and
balancing can only fill what an even step leaves idle (docs/data-parallel.md)."""
BALANCE_BAR = 0.8


def model_parity(device: str, precision: str) -> str:
    """(a): one forward and backward of the 1-process GPT on ``device`` and on the CPU."""
    import torch

    from hybrid.planning.config import ModelConfig

    m = ModelConfig(**TINY)
    data = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, m.vocab, (4, m.seq_len), generator=data)
    labels = torch.randint(0, m.vocab, (4, m.seq_len), generator=data)
    ref_loss, ref_grads = _loss_and_grads(m, "cpu", precision, tokens, labels)
    loss, grads = _loss_and_grads(m, device, precision, tokens, labels)
    loss_tol, grad_tol = TOLERANCE[precision]
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    grad_err = max((grads[n] - g).norm().item() / max(g.norm().item(), 1e-30)
                   for n, g in ref_grads.items())
    detail = (f"loss {loss:.6f} vs cpu {ref_loss:.6f} (rel {loss_err:.1e} <= {loss_tol:g}), "
              f"worst gradient rel {grad_err:.1e} <= {grad_tol:g}")
    if loss_err > loss_tol or grad_err > grad_tol or set(grads) != set(ref_grads):
        raise CheckFailed(detail)
    return detail


def _loss_and_grads(m, device: str, precision: str, tokens, labels):
    import contextlib

    import torch

    from hybrid.groups import ParallelGroups
    from hybrid.planning.layout import Layout
    from hybrid.model import GPT

    dev = torch.device(device)
    model = GPT(m, ParallelGroups.create(Layout(), device=dev), seed=7)
    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    with autocast:
        loss = model(tokens.to(dev), labels.to(dev))
    loss.backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()}
    return loss.item(), grads


class CheckFailed(Exception):
    """A check ran and its figures are out of bounds: the line says which."""


class Skipped(Exception):
    """A check this machine cannot run: the line says what it lacks."""


def hybrid_train(run_dir: Path, overrides: list[str]) -> list[dict]:
    """One ``hybrid-train`` run; its metrics records."""
    done = subprocess.run([str(BIN / "hybrid-train"), *overrides, f"hydra.run.dir={run_dir}",
                           "train.overwrite=true"], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise CheckFailed(f"hybrid-train {' '.join(overrides)} exited {done.returncode}: "
                          f"{(done.stderr.strip().splitlines() or [''])[-1]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def same_losses(losses: list[float], reference: list[float]) -> str:
    """DESIGN's fp32 layout tolerance; the worst relative difference."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    first = abs(losses[0] - reference[0]) / abs(reference[0])
    detail = f"{len(losses)} losses, worst rel {worst:.1e} (step 1: {first:.1e})"
    if len(losses) != len(reference) or first > 1e-5 or worst > 1e-4:
        raise CheckFailed(detail)
    return detail


def trainer_parity(device: str, out: Path, losses_of: dict) -> str:
    """(b): the trainer on ``device`` with the timeline against the same run on the CPU."""
    run = [*TINY_RUN, "parallel=single", "train.steps=4", "train.timeline_step=2"]
    reference = [r["loss"] for r in hybrid_train(out / "b-cpu", [*run, "train.device=cpu"])]
    records = hybrid_train(out / f"b-{device}", [*run, f"train.device={device}"])
    losses_of[device] = [r["loss"] for r in records]
    bubble = json.loads((out / f"b-{device}" / "timeline_bubble.json").read_text())
    if not 0 <= bubble["measured"] < 1 or not bubble["makespan_s"] > 0:
        raise CheckFailed(f"timeline: bubble {bubble['measured']}, makespan "
                          f"{bubble['makespan_s']} s")
    return (f"{same_losses(losses_of[device], reference)}; timeline makespan "
            f"{bubble['makespan_s'] * 1e3:.1f} ms")


def throughput(device: str, out: Path, small: bool) -> str:
    """(c): tokens/s and MFU of hybrid-train on one device (bf16), median of later steps."""
    from hybrid.planning.config import from_dict
    from hybrid.planning.cost.devices import ACHIEVED_COMPUTE, PRESETS
    from hybrid.planning.cost.flops import model_flops_per_step

    shape = TINY_RUN[:2] if small else GPT2
    batch = ["train.global_batch=8", "train.micro_batch=4"] if small else [
        "train.global_batch=16", "train.micro_batch=8"]
    records = hybrid_train(out / "c", [*shape, *batch, "parallel=single", "train.steps=12",
                                       "train.precision=bf16", f"train.device={device}",
                                       "train.timeline_step=0", "train.log_every=100"])
    cfg = from_dict(json.loads((out / "c" / "config.json").read_text()))
    step_s = statistics.median(r["step_time_s"] for r in records[4:])
    tokens = cfg.train.global_batch * cfg.model.seq_len / step_s
    # the H200's bf16 dense peak (hybrid/planning/cost/devices.py); on the CPU dry run, its preset's rate
    peak = PRESETS["h200" if device == "cuda" else "cpu"].flops["bf16"] / (
        ACHIEVED_COMPUTE if device == "cuda" else 1)
    mfu = model_flops_per_step(cfg) / step_s / peak
    detail = (f"{cfg.model.layers} layers h={cfg.model.hidden} seq {cfg.model.seq_len}: "
              f"step {step_s * 1e3:.1f} ms, {tokens:,.0f} tokens/s, MFU {mfu:.1%} of "
              f"{peak / 1e12:.4g} TFLOP/s bf16; last loss {records[-1]['loss']:.4f}")
    if not (0 < mfu <= 1 and math.isfinite(records[-1]["loss"])):
        raise CheckFailed(detail + " (MFU above 1: a timing that missed a synchronisation)")
    return detail


def layouts_parity(device: str, out: Path, losses_of: dict, gpus: int) -> str:
    """(d): dp2, tp2 and pp2 (measured partition, timeline) against (b)'s 1-process run."""
    if gpus < 2:
        raise Skipped(f"needs 2 or more GPUs, this machine has {gpus}")
    run = [*TINY_RUN, "parallel=single", "train.steps=4", "train.timeline_step=2",
           f"train.device={device}"]
    details = []
    for name, layout in (("dp2", ["parallel.dp=2"]), ("tp2", ["parallel.tp=2"]),
                         ("pp2", ["parallel.pp=2", "parallel.partition=measured"])):
        records = hybrid_train(out / f"d-{name}", [*run, *layout])
        details.append(f"{name}: {same_losses([r['loss'] for r in records], losses_of[device])}")
    return "; ".join(details)


def replica_balance(out: Path) -> str:
    """(e): the throttled-replica bench on the host's cores, two rounds a layout."""
    cores = len(os.sched_getaffinity(0))
    if cores < BALANCE_CORES:
        raise Skipped(f"needs {BALANCE_CORES} or more cores, this machine has {cores}")
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("dp_balance.py")), "--layouts",
         "dp2xpp2-1f1b,dp4-zero2", "--rounds", "2", "--stop-ms", "20", "--run-ms", "20",
         "--out", str(out / "e")], capture_output=True, text=True, timeout=3 * RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise CheckFailed(f"bench/dp_balance.py exited {done.returncode}: "
                          f"{done.stderr.strip().splitlines()[-1:]}")
    lines = [line for line in done.stdout.splitlines() if "ratio=" in line]
    ratios = {line.split(":")[0]: float(line.rsplit("ratio=", 1)[1]) for line in lines}
    losses = {}
    for line in done.stdout.splitlines():
        if "last loss" in line:
            layout = line.split()[0]
            losses.setdefault(layout, set()).add(line.split("last loss")[1].split()[0])
    detail = "; ".join(lines)
    if len(ratios) != 2 or any(r > BALANCE_BAR for r in ratios.values()) \
            or any(len(seen) != 1 for seen in losses.values()):
        raise CheckFailed(f"dynamic/even above {BALANCE_BAR} or losses differ: {detail}")
    return detail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: dry run
    parser.add_argument("--out", help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")  # megatron's
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: CUDA is not available here (torch {torch.__version__}); nothing "
              f"checked, run it on a machine with an NVIDIA GPU")
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-check-"))
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2  # dry run: 2 gloo ranks
    _one_process_group()
    losses_of: dict = {}
    checks = [("a fp32 model vs cpu", lambda: model_parity(args.device, "fp32")),
              ("a bf16 model vs cpu", lambda: model_parity(args.device, "bf16")),
              ("b trainer+timeline vs cpu", lambda: trainer_parity(args.device, out, losses_of)),
              ("c throughput bf16", lambda: throughput(args.device, out, args.device == "cpu")),
              ("d dp2/tp2/pp2 vs 1 process", lambda: layouts_parity(args.device, out, losses_of,
                                                                    gpus)),
              ("e replica balance on the cores", lambda: replica_balance(out))]
    print(f"gpu_check on {_device_name(args.device)}; runs in {out}", flush=True)
    outcomes = [_run_check(name, check) for name, check in checks]
    failed = outcomes.count("FAIL")
    print(f"summary: {outcomes.count('PASS')} passed, {failed} failed, "
          f"{outcomes.count('SKIP')} skipped")
    sys.exit(1 if failed else 0)


def _run_check(name: str, check) -> str:
    started = time.perf_counter()
    try:
        outcome, detail = "PASS", check()
    except Skipped as why:
        outcome, detail = "SKIP", str(why)
    except Exception as err:  # every failure is reported as its check's line
        outcome, detail = "FAIL", f"{type(err).__name__}: {err}".splitlines()[0]
    print(f"{outcome} {name}: {detail} ({time.perf_counter() - started:.0f} s)", flush=True)
    return outcome


def _one_process_group() -> None:
    """(a) builds the 1-process model, whose groups need a (1-rank) default process group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _device_name(device: str) -> str:
    import torch

    if device != "cuda":
        return f"{device} (dry run of the script's logic)"
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


if __name__ == "__main__":
    main()
