"""``Checkpointer``: what the training loop calls to save, resume and finish checkpoints.

Saving (every rank, collective): the state is written by DCP into ``step_XXXXXXXX.tmp``;
then every rank reports the size and CRC-32 of the files it wrote, rank 0 writes the manifest
(last) and renames the directory to ``step_XXXXXXXX``, then removes interrupted saves and
checkpoints beyond ``checkpoint.keep``. A kill at any moment leaves either the complete
checkpoint or a ``.tmp`` directory that nothing reads.

With ``checkpoint.async_save`` the state is copied to host memory and written by a background
thread over a process group of its own; every step the ranks agree (one small all-reduce)
whether all of them have finished writing, and then finish the checkpoint as above. At most
one save is in flight: the next one, and the end of training, wait for it.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from hybrid.diagnosis import faults
from hybrid.checkpoint.dcp_io import HostCopyStager, as_global, file_checksums, tp_mesh, \
    verify_files
from hybrid.checkpoint.publish import build_manifest, replace_dir, write_errors_named
from hybrid.checkpoint.restore import check_every_key_loaded, load_targets, read_checkpoint
from hybrid.checkpoint.store import TOKENIZER_FILE, checkpoint_dir, checkpoint_name, \
    partial_name, prune, read_manifest, resolve_resume, write_manifest
from hybrid.checkpoint.weights import (check_no_foreign_tensors, fit_positions,
                                       read_model_weights)
from hybrid.data.fingerprint import run_data_record
from hybrid.interop.gpt2 import pad_vocabulary
from hybrid.model.expert_bias import expert_biases, load_expert_biases
from hybrid.model.shards import load_global_weights
from hybrid.dp.option_state import PREFIX as OPTION_PREFIX
from hybrid.dp.option_state import (
    load_option_state, option_state, option_targets, same_option_layout,
)
from hybrid.dp.state import MOMENTS
from hybrid.optim import unique_parameters
from hybrid.planning.params import model_param_specs


def checkpoints_of(plan, run_dir: Path) -> Path:
    """Where ``plan``'s run keeps its checkpoints."""
    return Path(plan.checkpoint_dir) if plan.checkpoint_dir \
        else checkpoint_dir(plan.cfg, run_dir)


def resume_path(plan, directory: Path) -> Optional[Path]:
    """The checkpoint a run of ``plan`` resumes from (None: a fresh start). A worker group
    restarted by the elastic agent resumes from the newest complete checkpoint in
    ``directory``; else what the plan resumes from (resolved before launch); a plan not made
    for a run (a test, a bench) resolves ``checkpoint.resume_from`` here."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        path = resolve_resume("auto", directory)
        if path is not None:
            return path
    if plan.checkpoint_dir is not None:
        return None if plan.resume_from is None else Path(plan.resume_from)
    return resolve_resume(plan.cfg.checkpoint.resume_from, directory)


class Checkpointer:
    """Saves and loads one rank's share of the job's state (model, AdamW, step, RNG)."""

    def __init__(self, plan, groups, chunks: dict, sync, run_dir: Path, shares=None):
        """``plan``: the job's ``JobPlan``; for a run made by ``hybrid-train`` it names the
        checkpoint directory and the checkpoint to resume from, checked before launch.
        ``shares``: the DP replicas' shares of the step (``hybrid.balance.replicas``), saved
        and restored with the rest."""
        cfg = plan.cfg
        self.plan, self.cfg, self.groups, self.sync = plan, cfg, groups, sync
        self.directory = checkpoints_of(plan, run_dir)
        self.run_dir = Path(run_dir)
        self.rank, self.world = groups.world.rank(), groups.world.size()
        self.mesh = tp_mesh(groups)
        self.chunks, self.shares = chunks, shares
        self.params = unique_parameters(chunks.values())
        self.specs = {spec.name: spec for spec, _ in self.params}
        self.biases = expert_biases(chunks.values())
        """The MoE layers' aux-loss-free expert biases (buffers, the same on every rank that
        holds the layer), saved as plain tensors beside the weights."""
        # DCP's async save runs collectives from its own thread: never on the training groups.
        self.async_group = None
        if cfg.checkpoint.async_save:
            timeout = timedelta(seconds=cfg.train.collective_timeout_s)
            self.async_group = dist.new_group(backend="gloo", timeout=timeout)
        self.pending: Optional[tuple] = None
        self.resumed_from: Optional[str] = None
        """The checkpoint this rank loaded, if any."""
        self.initialised_from: Optional[str] = None
        """The checkpoint whose weights this run started from (``checkpoint.init_from``)."""
        self.stall_s = 0.0
        """Seconds the training loop spent inside ``save`` (the stall a save causes)."""
        self._data: Optional[dict] = None
        self.quiet = False
        """No console line per save (a checkpoint that only moves the state elsewhere)."""

    # ----- what is saved ---------------------------------------------------------------------
    def _state(self, step: int) -> dict:
        state = {f"model.{spec.name}": as_global(param.detach(), spec, self.mesh)
                 for spec, param in self.params}
        state.update({f"model.{name}": bias for name, bias in self.biases.items()})
        for name, moments in self.sync.state_dict().items():
            for key in MOMENTS:
                state[f"optim.{name}.{key}"] = as_global(moments[key], self.specs[name], self.mesh)
            state[f"optim.{name}.step"] = moments["step"]
        state.update(option_state(self.sync))
        state["train.step"] = torch.tensor(step, dtype=torch.int64)
        state["rng.cpu"] = torch.get_rng_state()
        if self.shares is not None:
            state.update(self.shares.checkpoint_state())
        return state

    # ----- saving ----------------------------------------------------------------------------
    def after_step(self, step: int) -> None:
        """Finish a background save that every rank has written; save if this step is due."""
        if self.pending is not None and self._all_written(block=False):
            self._finish_pending()
        every = self.cfg.checkpoint.every
        if every > 0 and step % every == 0:
            self.save(step)

    def save(self, step: int) -> None:
        started = time.perf_counter()
        if self.pending is not None:
            self._all_written(block=True)
            self._finish_pending()
        partial = self.directory / partial_name(step)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # a save interrupted at this step
            partial.mkdir(parents=True)
        self.groups.world.barrier()
        writer = FileSystemWriter(partial)
        if self.async_group is None:
            with write_errors_named(partial), self.sync.whole_weights(self.chunks):
                dcp.save(self._state(step), storage_writer=writer)
            self._finish(step, partial)
            self._announce(step, time.perf_counter() - started)
        else:
            with self.sync.whole_weights(self.chunks):  # staged (copied) before it returns
                future = dcp.async_save(self._state(step), storage_writer=writer,
                                        process_group=self.async_group,
                                        async_stager=HostCopyStager())
            self.pending = (future, step, partial, time.perf_counter() - started)
        self.stall_s += time.perf_counter() - started

    def _announce(self, step: int, stall_s: float) -> None:
        """One console line per checkpoint that became visible (rank 0)."""
        if self.rank == 0 and not self.quiet:
            print(f"checkpoint saved: {self.directory / checkpoint_name(step)} (training "
                  f"waited {stall_s:.2f} s for it)", flush=True)

    def close(self) -> None:
        """Wait for a background save and finish it (call once training is done)."""
        if self.pending is not None:
            self._all_written(block=True)
            self._finish_pending()

    def _all_written(self, *, block: bool) -> bool:
        future = self.pending[0]
        if block:
            future.result()
        done = torch.tensor([1 if future.done() else 0], dtype=torch.int64)
        self.groups.world.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def _finish_pending(self) -> None:
        future, step, partial, stall_s = self.pending
        self.pending = None
        with write_errors_named(partial):
            future.result()  # raises here if the background write failed
        self._finish(step, partial)
        self._announce(step, stall_s)

    def _finish(self, step: int, partial: Path) -> None:
        """Every rank's files are written: record them, then make the checkpoint visible."""
        faults.maybe_die("die_in_save", step=step, rank=self.rank)
        files = self.groups.world.all_gather_objects(file_checksums(partial, self.rank))
        if self.rank == 0:
            tokenizer = self.run_dir / TOKENIZER_FILE
            if tokenizer.is_file():  # the data's tokenizer travels with the model
                shutil.copyfile(tokenizer, partial / TOKENIZER_FILE)
            write_manifest(partial, self._manifest(step, partial, files))
            replace_dir(partial, self.directory / checkpoint_name(step))
            prune(self.directory, self.cfg.checkpoint.keep)
        self.groups.world.barrier()

    def _manifest(self, step: int, partial: Path, files: list[dict]) -> dict:
        return build_manifest(step, partial, files, plan=self.plan, layout=self.groups.layout,
                              world=self.world, data=self._data_record())

    def _data_record(self) -> dict:
        """What the run's data is (``hybrid.data.fingerprint``): read once, on rank 0."""
        if self._data is None:
            self._data = run_data_record(self.cfg, tuple(self.plan.data_prefixes),
                                         self.plan.tokenizer)
        return self._data

    # ----- loading ---------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the checkpoint this run resumes from, if any; returns its step (0: fresh).

        A worker group restarted by the elastic agent resumes from the newest complete
        checkpoint in ``checkpoint.dir``, whatever ``resume_from`` said."""
        path = resume_path(self.plan, self.directory)
        if path is None:
            if self.plan.init_from is not None:
                self.load_weights(Path(self.plan.init_from))
            elif self.cfg.model.from_hf is not None:
                self.load_hf(self.cfg.model.from_hf)
            return 0
        self.resumed_from = str(path)
        return self.load(path)

    def say_where_it_starts(self, start_step: int) -> None:
        """Rank 0, before the first step: the checkpoint this run (or this attempt, after a
        restart) resumed from, or the weights it started from."""
        if self.resumed_from is not None:
            print(f"resumed from {self.resumed_from} (step {start_step})", flush=True)
        if self.initialised_from:
            print(f"started from the weights of {self.initialised_from} (step 0, a fresh "
                  f"optimizer)", flush=True)

    def load_weights(self, path: Path) -> None:
        """``checkpoint.init_from``: the model weights of checkpoint ``path`` (any layout, or
        an imported HF model) into this rank's parameters; the optimizer starts fresh. Every
        rank reads the whole model once and keeps its own shards."""
        weights = fit_positions(read_model_weights(path), self.cfg.model.seq_len)
        weights = pad_vocabulary(weights, self.cfg.model.padded_vocab)
        weights = load_expert_biases(self.chunks.values(), weights)
        check_no_foreign_tensors(weights, set(model_param_specs(self.cfg.model)), path)
        names = {spec.name for spec, _ in self.params}
        with self.sync.whole_weights(self.chunks, write_back=True):
            load_global_weights([param for _, param in self.params],
                                {name: t for name, t in weights.items() if name in names},
                                self.groups)
        self.initialised_from = str(path)

    def load_hf(self, hf_dir: str) -> None:
        """``model.from_hf``: an HF folder's weights into this rank's parameters."""
        from hybrid.interop.hf_source import load_hf_weights

        with self.sync.whole_weights(self.chunks, write_back=True):
            load_hf_weights(hf_dir, self.cfg.model,
                            {spec.name: param for spec, param in self.params}, self.groups)
        self.initialised_from = hf_dir

    def load(self, path: Path) -> int:
        """Load checkpoint ``path`` (saved on any layout) into this rank's model and AdamW."""
        manifest = read_manifest(path)
        verify_files(path, manifest, self.groups.world)
        targets, moments = load_targets(self.params, self.groups.layout, self.mesh)
        targets.update(self._bias_targets(path, manifest["tensors"]))
        shares = {} if self.shares is None else self.shares.checkpoint_targets(
            manifest["tensors"])
        targets.update(shares)
        options = same_option_layout(manifest["config"], self.cfg)
        if options:
            targets.update(option_targets(self.sync))
        elif self.rank == 0 and any(k.startswith(OPTION_PREFIX) for k in manifest["tensors"]):
            print(f"note: {path} was saved on another layout or DP options; "
                  f"parallel.dp_compress / dp_delay state starts afresh", file=sys.stderr)
        with self.sync.whole_weights(self.chunks, write_back=True):
            read_checkpoint(path, targets)
        check_every_key_loaded(path, targets, self.groups.world)
        self.sync.load_state_dict(moments)
        if options:
            load_option_state(self.sync, targets)
        torch.set_rng_state(targets["rng.cpu"])
        if shares:
            self.shares.load_checkpoint_state(targets)
        return int(targets["train.step"])

    def _bias_targets(self, path: Path, saved: dict) -> dict:
        """The expert biases to load in place: those the checkpoint holds. A checkpoint
        saved without them (``model.moe.expert_bias_rate`` was 0, or an older hybrid) leaves
        them at zero, the unbiased routing it was trained with (rank 0 says so)."""
        found = {f"model.{name}": bias for name, bias in self.biases.items()
                 if f"model.{name}" in saved}
        if len(found) < len(self.biases) and self.groups.world.rank() == 0:
            print(f"note: {path} holds no MoE expert bias; the bias starts at zero and "
                  f"model.moe.expert_bias_rate={self.cfg.model.moe.expert_bias_rate} moves it "
                  f"from here", file=sys.stderr, flush=True)
        return found
