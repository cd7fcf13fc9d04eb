"""hybrid's checkpoints against a plain ``torch.distributed.checkpoint`` save/load of the same
tensors, and the training stall of a synchronous vs an asynchronous save, in one run.

    .venv/bin/python bench/checkpoint_vs_dcp.py               # small model, 2x2x2, 8 ranks
    .venv/bin/python bench/checkpoint_vs_dcp.py --repeats 5
    .venv/bin/python bench/checkpoint_vs_dcp.py --smoke   # the smallest run: 2 ranks, tiny

Part 1, per repeat, alternating the two sides on the same 8 gloo processes:
- hybrid: ``Checkpointer.save`` (the state by global name: DTensors over TP, ZeRO moments
  gathered; DCP save into ``step_*.tmp``; per-rank CRC-32 of its files; manifest; rename) and
  ``Checkpointer.load`` (CRC check of every file, DCP load, optimizer state placed, key check);
- DCP: ``dcp.save`` / ``dcp.load`` of the very state dict hybrid builds (built untimed).
Seconds are the slowest rank's (a barrier before and after each), medians over repeats;
bytes are what each rank wrote. ``ratio=`` is hybrid / DCP of save + load seconds.

Part 2: ``hybrid-train``'s loop (``Trainer.run``) saving after every step, synchronously and
with ``checkpoint.async_save=true``: the stall is the time the loop spends inside ``save``
per checkpoint; an async save holds a host copy of the rank's state until it is written
(its bytes, and the growth of the peak resident memory over the synchronous run, printed).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.planning.config import (  # noqa: E402
    CheckpointConfig, Config, ModelConfig, ParallelConfig, TrainConfig, to_dict,
)
from hybrid.testing import barrier_timed, spawn  # noqa: E402

SMALL = ModelConfig(name="small", layers=4, hidden=128, heads=4, seq_len=64)
TINY = ModelConfig(name="tiny", layers=2, hidden=32, heads=4, seq_len=32)
MAIN_LAYOUT = {"dp": 2, "tp": 2, "pp": 2}
SMOKE_LAYOUT = {"dp": 1, "tp": 1, "pp": 2}  # --smoke: still a pipeline's two stages


def job_config(steps: int, every: int, async_save: bool, zero: int, smoke: bool = False
               ) -> Config:
    layout = SMOKE_LAYOUT if smoke else MAIN_LAYOUT
    return Config(model=TINY if smoke else SMALL,
                  parallel=ParallelConfig(**layout, zero=zero if layout["dp"] > 1 else 0),
                  train=TrainConfig(steps=steps, global_batch=16, micro_batch=2,
                                    timeline_step=0, log_every=10_000),
                  checkpoint=CheckpointConfig(every=every, keep=1, async_save=async_save))


def _rank_bytes(directory: Path, rank: int) -> int:
    return sum(f.stat().st_size for f in Path(directory).glob(f"__{rank}_*.distcp"))


def _save_load(rank, world, cfg_dict, tmp, repeats):
    import torch.distributed.checkpoint as dcp

    from hybrid.planning.config import from_dict
    from hybrid.groups import ParallelGroups
    from hybrid.checkpoint.restore import load_targets
    from hybrid.train import Trainer
    from hybrid.planning.job import plan_job

    cfg = from_dict(cfg_dict)
    plan = plan_job(cfg)
    trainer = Trainer(plan, ParallelGroups.create(plan.layout), Path(tmp) / "run")
    trainer.step(1)  # AdamW has state from here on
    ckpt = trainer.checkpointer
    times = {key: [] for key in ("hybrid save", "dcp save", "hybrid load", "dcp load")}
    for r in range(repeats):
        plain = Path(tmp) / f"plain_{r}"
        times["hybrid save"].append(barrier_timed(lambda: ckpt.save(r + 1)))
        state = ckpt._state(r + 1)
        times["dcp save"].append(barrier_timed(lambda: dcp.save(state, checkpoint_id=plain)))
        saved = ckpt.directory / f"step_{r + 1:08d}"
        times["hybrid load"].append(barrier_timed(lambda: ckpt.load(saved)))
        targets, _ = load_targets(ckpt.params, ckpt.groups.layout, ckpt.mesh)
        times["dcp load"].append(barrier_timed(lambda: dcp.load(targets, checkpoint_id=plain)))
    return {"times": times, "hybrid_bytes": _rank_bytes(saved, rank),
            "dcp_bytes": _rank_bytes(plain, rank)}


def _stall(rank, world, cfg_dicts, tmp):
    """Each config's training run, in order; peak RSS is the process's, so the growth of one
    run over the previous one is what that run added."""
    from hybrid.planning.config import from_dict
    from hybrid.groups import ParallelGroups
    from hybrid.train import Trainer
    from hybrid.planning.job import plan_job

    out = {}
    for name, cfg_dict in cfg_dicts.items():
        cfg = from_dict(cfg_dict)
        plan = plan_job(cfg)
        trainer = Trainer(plan, ParallelGroups.create(plan.layout), Path(tmp) / name)
        start = time.perf_counter()
        trainer.run()
        wall = time.perf_counter() - start
        state = trainer.checkpointer._state(cfg.train.steps)
        out[name] = {"wall": wall, "stall": trainer.checkpointer.stall_s,
                     "state_bytes": sum(_local(t).numel() * _local(t).element_size()
                                        for t in state.values()),
                     "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    return out


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def report_save_load(results: list[dict]) -> float:
    medians = {key: statistics.median(max(r["times"][key][i] for r in results)
                                      for i in range(len(results[0]["times"][key])))
               for key in results[0]["times"]}
    for side in ("hybrid", "dcp"):
        print(f"{side:>6}: save {medians[side + ' save']:.3f} s  load "
              f"{medians[side + ' load']:.3f} s  bytes/rank "
              + " ".join(str(r[side + "_bytes"]) for r in results))
    return ((medians["hybrid save"] + medians["hybrid load"])
            / (medians["dcp save"] + medians["dcp load"]))


def report_stall(results: list[dict], saves: int) -> None:
    for name in ("sync", "async"):
        stall = max(r[name]["stall"] for r in results) / saves
        wall = max(r[name]["wall"] for r in results)
        print(f"{name:>6} save: stall {stall * 1e3:7.1f} ms per checkpoint, run {wall:.2f} s "
              f"(no checkpoints: {max(r['none']['wall'] for r in results):.2f} s)")
    held = max(r["async"]["state_bytes"] for r in results)
    growth = max(r["async"]["peak_rss"] - r["sync"]["peak_rss"] for r in results)
    print(f"async save holds a host copy of {held / 2**20:.1f} MiB per rank until written; "
          f"peak RSS grew by {max(growth, 0) / 2**20:.1f} MiB over the synchronous run")
    sync = max(r["sync"]["stall"] for r in results)
    asyn = max(r["async"]["stall"] for r in results)
    print(f"stall ratio={asyn / sync:.3f} (async / sync)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="steps of the stall runs")
    parser.add_argument("--zero", type=int, default=1, help="ZeRO stage of the job")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the test "
                        "suite's): tiny GPT, pp 2 on 2 ranks, 1 repeat, 2 steps")
    args = parser.parse_args()
    if args.smoke:  # what the command line gave explicitly stays
        args = parser.parse_args(namespace=argparse.Namespace(repeats=1, steps=2))
    # read by the fork server before it imports megatron-core, which warns on CPU machines
    os.environ.setdefault("PYTHONWARNINGS", "ignore:Transformer Engine and Apex are not installed")
    job = job_config(args.steps, 0, False, args.zero, args.smoke)
    ranks = job.parallel.dp * job.parallel.tp * job.parallel.pp
    print(f"{job.model.name} GPT (layers {job.model.layers}, hidden {job.model.hidden}), "
          f"dp {job.parallel.dp} x tp {job.parallel.tp} x pp {job.parallel.pp}, zero "
          f"{job.parallel.zero}, {ranks} ranks")
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        results = spawn(_save_load, ranks, to_dict(job), tmp, args.repeats, timeout=3600)
        ratio = report_save_load(results)
        runs = {"none": job, "sync": job_config(args.steps, 1, False, args.zero, args.smoke),
                "async": job_config(args.steps, 1, True, args.zero, args.smoke)}
        stall = spawn(_stall, ranks, {k: to_dict(v) for k, v in runs.items()}, tmp,
                      timeout=3600)
        report_stall(stall, args.steps)
    print(f"ratio={ratio:.3f} (hybrid / plain DCP, save + load seconds)")


if __name__ == "__main__":
    main()
