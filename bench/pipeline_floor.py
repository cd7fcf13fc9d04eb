"""A pipeline against the 1-process run inside one job, and the floor of its CPU cost.

    .venv/bin/python bench/pipeline_floor.py                                  # pp2 1f1b
    .venv/bin/python bench/pipeline_floor.py --schedule zb-h1
    .venv/bin/python bench/pipeline_floor.py --pp 4 --vpp 2 --schedule interleaved-1f1b
    .venv/bin/python bench/pipeline_floor.py --smoke   # the smallest run (the test suite's)

``train_overhead.py`` compares separate runs, and on a shared machine two runs of one layout
differ by 10-20% in CPU per step: as much as the pipelines cost. Here one job of its model
(``small``, 8 layers, global batch 16, micro-batch 2) builds, on every rank, the pipeline's
``Trainer`` and a 1-process ``Trainer`` of the same model, seed and batch (on 1-rank groups:
``ParallelGroups`` makes one replica of the 1-process layout per rank), and alternates blocks
of ``--steps`` steps in four modes, so that the machine's drift hits all of them alike:

- ``single``: rank 0 trains the 1-process model while the other ranks sleep in a barrier
  (the 1-process run, on the same machine at the same minute);
- ``crowd``: every rank trains the 1-process model at once, each on its own groups: the same
  work as ``single``, with as many processes on the machine's cores as the pipeline has. Its
  CPU per rank over ``single``'s is what the machine charges for that crowding (the **tax**:
  a few percent for 2 processes on 2 cores, 11-23% for 4, which take turns and refill caches);
- ``real``: the pipeline step as ``hybrid-train`` runs it;
- ``local``: the same step with every RECV answered at once with a tensor one real step
  received (its shape and dtype) and every SEND dropped. What is left is the pipeline's work
  without its messages: each stage's compute in chunks, each rank's step-level work (data,
  optimizer, loss and norm collectives), and the ranks sharing the cores.

After the blocks, one real step's messages are replayed alone: every rank posts them all at
once and waits for them, no compute (``replay``: their own CPU cost, summed over ranks).

**floor = local + replay.** The real step's cost above the floor is the pipeline's rhythm:
ranks blocking and waking once per message (cold caches, switches). ``local / (single x
tax)`` is what the split model costs beyond the crowding: chunks, each rank's step work.
Prints each mode's CPU s/step summed over ranks (median over its blocks' steps; ``crowd``:
per rank), the floor, real / floor, and ``ratio=<real / single>`` last: the layout's CPU cost
over the 1-process run's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tp_floor import composed, cpu_trainer, job_words, train_overrides  # noqa: E402

MODES = ("single", "real", "local", "crowd")


class Completed:
    """A ``Work`` that is already done: what a dropped SEND or an answered RECV returns."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Messages:
    """Wraps ``hybrid.pipeline.p2p.post``: records what a real step posts and receives, and
    answers from that record in ``local`` mode."""

    def __init__(self, p2p):
        self.p2p, self.post = p2p, p2p.post
        self.received: dict = {}  # (kind, stage, mb) -> a tensor that RECV got
        self.batches: list = []  # (actions, payload tensors, post's keywords) of one step
        self.local = False
        self.recording = False  # keep what is posted (and its payloads) in ``batches``

    def __call__(self, actions, payloads, **kwargs):
        if self.local:
            sends = [(a, t, Completed()) for a, t in payloads.items()]
            recvs = [self.p2p.PendingRecv(a, Completed(), self.received[key(a)].detach().clone(),
                                          0.0)
                     for a in actions if a not in payloads]
            return sends, recvs
        if self.recording:
            self.batches.append((actions, dict(payloads), kwargs))
        sends, recvs = self.post(actions, payloads, **kwargs)
        for pending in recvs:
            self.received[key(pending.action)] = pending.buffer
        return sends, recvs

    def replay_cpu(self, reps: int, barrier) -> float:
        """Median CPU seconds of this rank to post the recorded step's messages at once and
        wait for them all (payloads are fresh tensors of the same shapes)."""
        times = []
        for _ in range(1 + reps):
            barrier()
            start, works = time.process_time(), []
            for actions, payloads, kwargs in self.batches:
                fresh = {a: t.detach().clone() for a, t in payloads.items()}
                sends, recvs = self.post(actions, fresh, **kwargs)
                works += [w for _, _, w in sends] + [p.work for p in recvs]
            for work in works:
                work.wait()
            times.append(time.process_time() - start)
        return statistics.median(times[1:])


def key(action) -> tuple:
    return action.kind, action.stage, action.mb


def lone_trainer(cfg_dict: dict, run_dir: Path, store, timeout):
    """The 1-process run's trainer on this rank's own 1-rank groups; its step reports this
    rank alone (the job-wide gather of ``Trainer`` would wait for the sleeping ranks)."""
    import torch

    from hybrid.planning.config import from_dict
    from hybrid.groups import ParallelGroups
    from hybrid.train import Trainer
    from hybrid.planning.job import plan_job

    class LoneTrainer(Trainer):
        def _gather(self, values):
            return [values]

    cfg = from_dict(cfg_dict)
    plan = plan_job(cfg)
    groups = ParallelGroups.create(plan.layout, torch.device("cpu"), timeout)
    return LoneTrainer(plan, groups, run_dir, store)


def measure(cfg_dicts: dict, run_dir: str, blocks: int, steps: int) -> dict:
    """One rank: alternate the modes' blocks, then replay one real step's messages. Returns
    CPU seconds of each measured step by mode (summed over ranks; ``single``: rank 0's run;
    ``crowd``: this rank's run) and this rank's replay CPU."""
    from datetime import timedelta
    from unittest import mock

    import torch.distributed as dist

    from hybrid.pipeline import p2p

    trainer = cpu_trainer(cfg_dicts["pipeline"], Path(run_dir) / "pipeline")
    timeout = timedelta(seconds=trainer.cfg.train.collective_timeout_s)
    single = lone_trainer(cfg_dicts["single"], Path(run_dir) / "single", trainer.store,
                          timeout)
    messages = Messages(p2p)
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    step = 0
    with mock.patch.object(p2p, "post", messages):
        trainer.step(step := step + 1)  # a real step first: local mode answers from it
        for block in range(blocks + 1):
            for mode in (MODES if block % 2 else MODES[::-1]):
                messages.local = mode == "local"
                for _ in range(steps):
                    step += 1
                    if mode == "single" and dist.get_rank() != 0:
                        continue  # asleep in the barrier below while rank 0 runs alone
                    report = (single if mode in ("single", "crowd") else trainer).step(step)
                    if block and (dist.get_rank() == 0 or mode == "crowd"):  # block 0 warms up
                        cpu[mode].append(report.cpu_s)
                dist.barrier()
        messages.local, messages.recording = False, True
        trainer.step(step + 1)  # records the step's messages for the replay
    replay = messages.replay_cpu(blocks * steps, dist.barrier)
    for t in (trainer, single):
        t.sync.close()
    dist.destroy_process_group()
    return {"cpu": cpu, "replay": replay, "messages": sum(
        len(actions) for actions, _, _ in messages.batches)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the test "
                        "suite's): one block of one step of a 2-layer tiny model, global batch "
                        "4; its figures mean nothing")
    args = parser.parse_args()
    if args.smoke:  # what the command line gave explicitly stays
        args = parser.parse_args(namespace=argparse.Namespace(blocks=1, steps=1))
    from launch.launchers.local import run_local

    total = (args.blocks + 1) * args.steps * len(MODES) + 2
    single = [*train_overrides("small", total, args.smoke), "parallel=single"]
    cfgs = {"pipeline": composed([*single, f"parallel.pp={args.pp}", f"parallel.vpp={args.vpp}",
                                  f"parallel.schedule={args.schedule}"]),
            "single": composed(single)}
    with tempfile.TemporaryDirectory() as run_dir:
        for name in cfgs:
            (Path(run_dir) / name).mkdir()
        results = run_local(measure, (cfgs, run_dir, args.blocks, args.steps),
                            nproc=args.pp, omp_threads=1, run_dir=run_dir)
    med = {mode: statistics.median(results[0]["cpu"][mode]) for mode in MODES}
    med["crowd"] = statistics.mean(statistics.median(r["cpu"]["crowd"]) for r in results)
    tax = med["crowd"] / med["single"]
    replay = sum(r["replay"] for r in results)
    floor = med["local"] + replay
    print(f"pp={args.pp} vpp={args.vpp} {args.schedule}; {job_words(smoke=args.smoke)}; CPU s/step "
          f"summed over ranks, median of {args.blocks * args.steps} steps per mode, modes "
          f"alternating in one job")
    print(f"single {med['single']:.3f}  (the 1-process run, rank 0 alone)")
    print(f"crowd  {med['crowd']:.3f}  (per rank, all {args.pp} ranks training it at once: "
          f"tax {tax:.2f}x on {os.cpu_count()} cores)")
    print(f"real   {med['real']:.3f}  ({med['real'] / med['single']:.2f}x single)")
    print(f"local  {med['local']:.3f}  ({med['local'] / med['single']:.2f}x single: the "
          f"pipeline without its messages; {med['local'] / (med['single'] * tax):.2f}x "
          f"single x tax)")
    print(f"replay {replay:.3f}  ({results[0]['messages']} messages per step on rank 0, alone)")
    print(f"floor  {floor:.3f}  (local + replay); real / floor = {med['real'] / floor:.3f}")
    print(f"ratio={med['real'] / med['single']:.3f}")


if __name__ == "__main__":
    main()
