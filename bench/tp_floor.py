"""The floor of tensor parallelism's CPU cost, and where a TP rank's CPU time goes.

    .venv/bin/python bench/tp_floor.py [--layout tp2] [--blocks 3] [--steps 3] [--profile]
    .venv/bin/python bench/tp_floor.py --smoke   # the smallest run (the test suite's)

One job of ``train_overhead.py``'s model (``small``, 8 layers, global batch 16, micro-batch 2)
on a TP layout builds one ``Trainer`` per rank and alternates blocks of ``--steps`` steps in
two modes (alternating keeps the machine's drift out of the comparison):

- ``real``: the training step as ``hybrid-train`` runs it;
- ``local``: the same step with every collective on the TP group answered at once without
  communicating (in-place results stay this rank's partial values). What is left is the work a
  TP rank cannot avoid in eager mode: its sharded matmuls (half-width on tp2), everything TP
  replicates (norms, residual adds, the position embedding, the optimizer on replicated
  parameters), each op's dispatch and autograd cost (every TP rank runs the whole graph), and
  the DP/PP/step traffic, which stays real.

After the blocks, the TP collectives one real step issued (method and size, logged on rank 0's
TP group) are replayed back to back with no compute: their own CPU cost.

**floor = local CPU s/step + replay CPU s/step** (both summed over ranks). What the real step
costs above it is what TP's communication costs beyond the collectives themselves: waiting for
the slower rank, skew, and whatever the collective path adds around the call. Prints one line
per mode, the replay, the floor, and ``ratio=<real / floor>`` last.

``--profile``: torch.profiler on rank 0 over one more block of real steps, summarised by kind
of work (self CPU time of the ops; "not in ops" is Python and waiting).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYOUTS = {"tp2": ["parallel=single", "parallel.tp=2"], "2x2x2": [],
           "tp2 sp": ["parallel=single", "parallel.tp=2", "parallel.sequence_parallel=true"]}


COLLECTIVES = {"all_reduce": 0, "all_gather_into": 0, "all_gather": 0, "reduce_scatter_into": 1}
"""hybrid's ``Group`` collectives, and which argument holds the payload ``CommCounter`` counts."""


@contextlib.contextmanager
def tp_collectives(group, log: list | None = None, stub: bool = False):
    """Within the block, log ``(method, payload bytes)`` of each collective on ``group`` (a
    ``hybrid.comm.Group``) and, with ``stub``, answer it at once instead of communicating.
    The bench replaces the methods of this one group object, never anything of torch."""
    import torch

    from hybrid.comm import tensor_bytes

    def wrap(name, original):
        def call(*args, **kwargs):
            if log is not None:
                log.append((name, tensor_bytes(args[COLLECTIVES[name]])))
            if not stub:
                return original(*args, **kwargs)
            if "gather" in name:  # fresh memory: every slot as if each rank sent ours
                fill_gathered(name, args)
            if not kwargs.get("async_op"):
                return None
            done = torch.futures.Future()
            done.set_result(None)
            return torch._C._distributed_c10d._create_work_from_future(done)
        return call

    for name in COLLECTIVES:
        setattr(group, name, wrap(name, getattr(group, name)))
    try:
        yield
    finally:
        for name in COLLECTIVES:
            delattr(group, name)  # the class's methods again


def fill_gathered(name: str, args: tuple) -> None:
    """A stubbed all-gather's output, every rank's slot holding this rank's input (the loss
    then stays finite: the cross entropy divides by a gathered sum)."""
    if name == "all_gather_into":
        out, mine = args[0], args[1]
        out.view(-1, mine.numel()).copy_(mine.reshape(1, -1))
        return
    for out in args[0]:
        out.zero_()


def replay_cpu(log: list, group, reps: int) -> float:
    """Median CPU seconds (this rank, gloo's threads included) to issue ``log`` back to back."""
    import torch

    world, calls = group.size(), []
    for name, payload in log:
        full = torch.ones(max(1, payload // 4))
        part = torch.ones(max(1, full.numel() // world))
        if name == "reduce_scatter_into":
            calls.append(lambda f=full, p=part: group.reduce_scatter_into(p, f))
        elif "gather" in name:
            calls.append(lambda f=full, p=part: group.all_gather_into(f, p))
        else:
            calls.append(lambda f=full: group.all_reduce(f))
    times = []
    for _ in range(1 + reps):
        group.barrier()
        start = time.process_time()
        for call in calls:
            call()
        times.append(time.process_time() - start)
    return statistics.median(times[1:])


def measure(cfg_dict: dict, run_dir: str, blocks: int, steps: int, profile: bool) -> dict:
    """One rank: alternate real and local blocks, replay its TP collectives; rank 0 returns
    the step reports' CPU seconds per mode (summed over ranks), every rank its replay CPU."""
    import torch.distributed as dist

    trainer = cpu_trainer(cfg_dict, run_dir)
    groups = trainer.groups
    cpu = {"real": [], "local": []}
    step, log = 0, []
    for block in range(blocks + 1):
        for mode in (("real", "local") if block % 2 else ("local", "real")):
            for _ in range(steps):
                step += 1
                with tp_collectives(groups.tensor, stub=mode == "local"):
                    report = trainer.step(step)
                if block:  # block 0 warms up both modes
                    cpu[mode].append(report.cpu_s)
    with tp_collectives(groups.tensor, log=log):
        trainer.step(step + 1)
    replay = replay_cpu(log, groups.tensor, reps=blocks * steps)
    table = None
    if profile:
        table = profile_steps(trainer, step + 2, steps, on=dist.get_rank() == 0)
    trainer.sync.close()
    dist.destroy_process_group()
    return {"cpu": cpu, "replay": replay, "calls": len(log),
            "payload": sum(p for _, p in log), "profile": table}


def profile_steps(trainer, first: int, steps: int, on: bool) -> dict | None:
    """Rank 0's step thread over ``steps`` real steps under torch.profiler: seconds per step by
    kind of work (the ops' self time) and the top ops; the other ranks just step."""
    from torch.profiler import ProfilerActivity, profile

    if not on:
        for step in range(first, first + steps):
            trainer.step(step)
        return None
    wall, cpu = time.perf_counter(), time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(first, first + steps):
            trainer.step(step)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    events = prof.events()
    # The step's own thread only: events on gloo's threads last as long as they wait.
    main = collections.Counter(e.thread for e in events).most_common(1)[0][0]
    kinds, ops = collections.Counter(), collections.Counter()
    for event in (e for e in events if e.thread == main):
        kinds[op_kind(event.name)] += event.self_cpu_time_total / 1e6 / steps
        ops[event.name] += event.self_cpu_time_total / 1e6 / steps
    kinds["Python between ops"] = wall / steps - sum(kinds.values())
    return {"kinds": dict(kinds), "ops": ops.most_common(12), "wall": wall / steps,
            "cpu": cpu / steps}


# (kind, substrings of the profiler's event name); first match wins. The TP mappings' own
# autograd nodes are where the synchronous collectives block: their self time is the wait.
OP_KINDS = (
    ("TP collectives (issue and wait)", ("ModelParallelRegion", "SequenceParallelRegion",
                                         "VocabParallelCrossEntropy", "c10d::", "gloo")),
    ("matmuls", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
                 "SplitBackwardLinear")),
    ("attention", ("scaled_dot_product", "softmax")),
    ("optimizer", ("Optimizer", "_foreach", "addcdiv", "addcmul", "lerp", "sqrt")),
    ("autograd engine", ("autograd::", "Backward", "AccumulateGrad")),
    ("copies, casts, views", ("copy", "clone", "contiguous", "aten::to", "view", "reshape",
                              "permute", "transpose", "aten::t", "expand", "unbind", "select",
                              "slice", "as_strided", "unsqueeze", "empty", "zero", "fill",
                              "ones", "aten::cat", "stack", "split", "flatten", "detach",
                              "resize", "alias")),
)


def op_kind(name: str) -> str:
    for kind, parts in OP_KINDS:
        if any(part in name for part in parts):
            return kind
    return "other ops (norms, GELU, adds, loss math)"


def train_overrides(model: str = "small", steps: int = 8, smoke: bool = False) -> list[str]:
    """``train_overhead.py``'s model, batch and data (its own ``hybrid-train`` overrides);
    ``smoke``: a 2-layer tiny model and a global batch of 4, the smallest run. Generated data:
    the benches that build ``Trainer`` in their own workers cannot open the main job's indexed
    data, which ``hybrid-train`` builds before its workers start."""
    model, layers, batch = ("tiny", 2, 4) if smoke else (model, 8, 16)
    return [f"model={model}", f"model.layers={layers}", "data=synthetic", f"train.steps={steps}",
            f"train.global_batch={batch}", "train.micro_batch=2", "train.timeline_step=0",
            "train.log_every=1000", "launcher.omp_threads=1"]


def job_words(model: str = "small", smoke: bool = False) -> str:
    """``train_overrides``' model and batch, in words."""
    return ("model tiny (2 layers), global batch 4" if smoke else
            f"model {model} (8 layers), global batch 16") + ", micro-batch 2"


def composed(overrides: list[str]) -> dict:
    """The config ``hybrid-train OVERRIDES`` would run, as the plain dict workers take."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hybrid.planning.config import to_dict
    from launch.commands.app import CONF_DIR, register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_dict(OmegaConf.to_object(compose(config_name="config", overrides=overrides)))


def cpu_trainer(cfg_dict: dict, run_dir):
    """In a ``run_local`` worker: join the job over gloo and build this rank's ``Trainer`` of
    ``cfg_dict`` as ``hybrid.worker`` does on CPU (``OMP_NUM_THREADS`` intra-op threads)."""
    import os
    from datetime import timedelta

    import torch

    from hybrid.planning.config import from_dict
    from hybrid.groups import ParallelGroups
    from hybrid.train import Trainer
    from hybrid.planning.job import plan_job
    from hybrid.worker import init_distributed

    cfg = from_dict(cfg_dict)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    timeout = timedelta(seconds=cfg.train.collective_timeout_s)
    store = init_distributed("gloo", timeout)
    plan = plan_job(cfg)  # a bench's worker plans for itself; hybrid-train's do not
    groups = ParallelGroups.create(plan.layout, torch.device("cpu"), timeout)
    return Trainer(plan, groups, Path(run_dir), store)


def run_floor(overrides: list[str], blocks: int, steps: int, profile: bool = False) -> dict:
    """Compose the config, run ``measure`` on its ranks; the medians and the floor."""
    from launch.launchers.local import run_local

    total = (2 * (blocks + 1) + 2) * steps + 2
    cfg = composed([*overrides, f"train.steps={total}"])
    par = cfg["parallel"]
    with tempfile.TemporaryDirectory() as run_dir:
        results = run_local(measure, (cfg, run_dir, blocks, steps, profile),
                            nproc=par["dp"] * par["tp"] * par["pp"], omp_threads=1,
                            run_dir=run_dir)
    real, local = (statistics.median(results[0]["cpu"][m]) for m in ("real", "local"))
    replay = sum(r["replay"] for r in results)
    return {"real": real, "local": local, "replay": replay, "floor": local + replay,
            "calls": results[0]["calls"], "payload": results[0]["payload"],
            "profile": results[0]["profile"]}


def print_profile(prof: dict) -> None:
    print(f"\nrank 0 under torch.profiler, real steps: {prof['wall']:.3f} s wall/step, "
          f"{prof['cpu']:.3f} s CPU/step (gloo's threads included); the step thread's wall "
          f"time by kind of work:")
    for kind, sec in sorted(prof["kinds"].items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<42} {sec:7.3f} s  {100 * sec / prof['wall']:5.1f}%")
    print("top ops (self time, s/step): " + ", ".join(f"{n} {s:.3f}" for n, s in prof["ops"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="tp2", choices=list(LAYOUTS))
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the test "
                        "suite's): one block of one step of a 2-layer tiny model, global batch "
                        "4; its figures mean nothing")
    args = parser.parse_args()
    if args.smoke:  # what the command line gave explicitly stays
        args = parser.parse_args(namespace=argparse.Namespace(blocks=1, steps=1))
    out = run_floor(train_overrides(smoke=args.smoke) + LAYOUTS[args.layout], args.blocks,
                    args.steps, args.profile)
    print(f"{args.layout}: {job_words(smoke=args.smoke)}; CPU s/step summed over ranks, median of "
          f"{args.blocks * args.steps} steps per mode")
    print(f"real  {out['real']:.3f}")
    print(f"local {out['local']:.3f}  (TP collectives answered without communicating)")
    print(f"replay {out['replay']:.3f}  ({out['calls']} TP collectives per step on rank 0, "
          f"{out['payload'] / 2**20:.1f} MiB, alone)")
    print(f"floor {out['floor']:.3f}  (local + replay)")
    if out["profile"]:
        print_profile(out["profile"])
    print(f"ratio={out['real'] / out['floor']:.3f}")


if __name__ == "__main__":
    main()
