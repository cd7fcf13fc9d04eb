"""``hybrid-train``: compose the config, check everything, then start the ranks.

Nothing starts until the whole config is validated and planned: a bad config exits with
status 2 and one line on stderr. The job's one plan (``hybrid.planning.job``) is written as
``plan.json`` beside ``config.json``; then the launcher ``launcher.name`` names (a registered
``launch.launchers.launcher.Launcher``) starts the ranks, each running ``hybrid.worker.worker_main`` on
that plan; if any fails, all stop and the command exits 1 naming the rank.

    hybrid-train                                  # the main job (DP 2 x TP 2 x PP 2)
    hybrid-train model=tiny parallel=single       # the 1-process reference
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hybrid.checkpoint.store import (
    WEIGHTS_KIND, CheckpointError, check_files, check_model_matches, checkpoint_dir,
    read_manifest, resolve_resume,
)
from hybrid.checkpoint.shape import setting_changes
from hybrid.data import validate_data
from hybrid.data.fingerprint import (changed_file, changed_tokenizer, data_files, fingerprint,
                                     order_changes)
from hybrid.errors import UserError
from hybrid.files import RunDirError, write_error, write_text
from hybrid.planning.config import Config
from hybrid.planning.cost.block_costs import known_block_costs
from hybrid.planning.cost.devices import device_for
from hybrid.planning.job import JobPlan, plan_job
from hybrid.planning.layout import LayoutError
from hybrid.planning.memory import check_memory
from hybrid.planning.validate import config_warnings, microbatches, validate_config
from launch.commands.app import (CONF_DIR, USER_ERROR_EXIT, available_memory, exit_user_error,
                        run_hydra_app, to_dataclass, typed_overrides)
from launch.commands.console import raise_if_interrupted, work_done
from launch.launchers.launcher import Launcher
from launch.launchers.registered import launcher_for, launcher_problem
from launch.launchers.run import (WORKER_FAILED_EXIT, failure_line, launch, report_results,
                                  save_run_files, start_workers_fork_server)
from launch.commands.replace_run import replace_old_run
from launch.commands.run_data import check_eval_early, with_run_data


QUICK_PLAN_MICROBATCHES = 1024
"""Micro-batches per step up to which the plan is built in well under a second: beyond, the
evaluation's reads are checked before it (``check_eval_early``); within, the memory check's
refusal, which says more, comes first and the evaluation's is checked with the data."""

RUN_FILES = ("config.json", "metrics.jsonl")
"""A directory holding one of these holds a run."""


def check_run_dir(cfg: Config, run_dir: Path, resuming: bool) -> None:
    """Refuse to mix two runs in one directory, and a directory that cannot be written."""
    held = [name for name in RUN_FILES if (run_dir / name).exists()]
    if held and not cfg.train.overwrite and not resuming:
        raise RunDirError(f"{run_dir} already holds a run ({held[0]}); resume it with "
                          f"checkpoint.resume_from={run_dir}, write elsewhere with "
                          f"hydra.run.dir=..., or replace it with train.overwrite=true")
    probe = run_dir / ".hybrid-write-test"
    write_text(probe, "")
    probe.unlink()


def check_fits(plan: JobPlan, launcher: Launcher) -> None:
    """The job's memory against what one node offers: this machine's when the ranks run here;
    ``launcher.mem_gb`` (CPU) for a Slurm job, whose nodes this machine cannot see."""
    cfg = plan.cfg
    if cfg.train.skip_memory_check:
        return
    if launcher.runs_here:
        limit, device = available_memory(cfg)
    elif cfg.launcher.mem_gb is not None and cfg.train.device == "cpu":
        limit, device = cfg.launcher.mem_gb * 2**30, "cpu"
    else:
        return
    if limit is not None:
        check_memory(plan, limit, device)


def chosen_launcher(cfg: Config) -> Launcher:
    """The registered launcher ``launcher.name`` names, once it accepts the config."""
    problem = launcher_problem(cfg)
    if problem:
        raise LayoutError(problem)
    return launcher_for(cfg.launcher.name)


def check_launchable(plan: JobPlan, launcher: Launcher) -> None:
    """What this machine and this launcher can run (hybrid-plan may plan more than that)."""
    launcher.check_here(plan)
    if plan.cfg.train.device == "cuda" and launcher.runs_here:
        import torch

        if not torch.cuda.is_available():
            raise LayoutError("train.device=cuda but CUDA is not available here; use "
                              "train.device=cpu or train.device=auto")


def resolve_checkpointing(cfg: Config, run_dir: Path
                          ) -> tuple[str, Optional[str], Optional[str]]:
    """(the checkpoint directory: ``checkpoint.dir``, default ``<run dir>/checkpoints``; the
    checkpoint ``resume_from`` names, or None; the one ``init_from`` names, or None), after
    checking them: complete, files whole, the model shape of the config, steps left."""
    directory = str(checkpoint_dir(cfg, run_dir).expanduser().resolve())
    if cfg.checkpoint.init_from is not None and cfg.checkpoint.resume_from is not None:
        raise CheckpointError("checkpoint.init_from and checkpoint.resume_from are both set: "
                              "init_from starts a new run from a model's weights (step 0, a "
                              "fresh optimizer), resume_from continues a run; drop one")
    path = resolve_resume(cfg.checkpoint.resume_from, Path(directory))
    check_overwrite_resume(cfg, path, run_dir, Path(directory))
    if path is not None:
        manifest = read_manifest(path)
        check_files(path, manifest)
        if manifest.get("kind") == WEIGHTS_KIND:
            raise CheckpointError(f"checkpoint {path} holds a model only (no optimizer, no "
                                  f"run to continue); start from it with "
                                  f"checkpoint.init_from={path}")
        check_model_matches(manifest, cfg.model, path)
        for change in setting_changes(manifest, cfg.model):
            print(f"warning: resuming with {change}: no weight depends on it, but the losses "
                  f"from here on are not the saved run's", file=sys.stderr)
        if manifest["step"] >= cfg.train.steps:
            raise CheckpointError(f"checkpoint {path} is at step {manifest['step']}, "
                                  f"train.steps={cfg.train.steps} leaves nothing to train; "
                                  f"raise train.steps (it counts from the run's start)")
    init = resolve_resume(cfg.checkpoint.init_from, Path(directory),
                          field="checkpoint.init_from")
    if init is not None:
        manifest = read_manifest(init)
        check_files(init, manifest)
        check_model_matches(manifest, cfg.model, init, padding=False)
        changes = setting_changes(manifest, cfg.model)
        if changes:  # a fine-tune may change them on purpose (a longer context's rope)
            print(f"note: starting from {init.name} with {', '.join(changes)}; no weight "
                  f"depends on these", file=sys.stderr)
    return directory, None if path is None else str(path), None if init is None else str(init)


def check_overwrite_resume(cfg: Config, resume: Optional[Path], run_dir: Path,
                           directory: Path) -> None:
    """``train.overwrite=true`` replaces the run in the run directory; resuming that same run
    (``auto``, or a checkpoint of it) continues it: the two contradict."""
    if not cfg.train.overwrite or cfg.checkpoint.resume_from is None:
        return
    ours = resume is not None and any(Path(resume).resolve().is_relative_to(place.resolve())
                                      for place in (run_dir, directory))
    if cfg.checkpoint.resume_from == "auto" or ours:
        raise CheckpointError(
            f"train.overwrite=true replaces the run in {run_dir}, checkpoint.resume_from="
            f"{cfg.checkpoint.resume_from} continues it; drop one: train.overwrite=false to "
            f"continue it, checkpoint.resume_from=null to replace it")


def check_checkpoint_dir(directory: Path, named: bool = True) -> None:
    """A run that saves checkpoints can create and write ``directory`` (``checkpoint.dir``):
    probed by making it and a file in it, then removing whatever the probe made, so that a
    run refused later leaves nothing behind (rank 0 makes it again at the first save)."""
    made = [parent for parent in (directory, *directory.parents) if not parent.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".hybrid-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        reason = err.strerror or str(err)
        where = f" ({err.filename})" if err.filename and str(err.filename) != str(directory) \
            else ""
        what = f"checkpoint.dir={directory}" if named else \
            f"the checkpoint directory {directory} (<run dir>/checkpoints)"
        raise CheckpointError(f"{what} cannot be created or written: {reason}{where}; "
                              f"choose another with checkpoint.dir=...") from None
    finally:
        for parent in made:  # the deepest first
            with contextlib.suppress(OSError):
                parent.rmdir()


def prepare(cfg: Config, run_dir: Path) -> tuple[JobPlan, Launcher]:
    """Every check that can be made before a worker starts, and the job's one plan; writes
    ``config.json`` and ``plan.json``."""
    from hybrid.interop.hf_source import with_hf_shape

    cfg = with_hf_shape(cfg, typed_overrides())
    launcher = chosen_launcher(cfg)
    validate_config(cfg)  # every value checked before the evaluation's reads are
    for warning in config_warnings(cfg):  # before any refusal of the checks below
        print(f"warning: {warning}", file=sys.stderr)
    if microbatches(cfg) > QUICK_PLAN_MICROBATCHES:  # its plan takes seconds to minutes
        check_eval_early(cfg)
    plan = plan_job(cfg, block_costs=known_block_costs(cfg))
    check_launchable(plan, launcher)
    check_fits(plan, launcher)
    start_workers_fork_server(plan, launcher)
    validate_data(cfg.data, cfg.model, cfg.train, cfg.eval)
    directory, resume, init = resolve_checkpointing(cfg, run_dir)
    peak = device_for(cfg.cost).peak_flops(cfg.train.precision)
    plan = plan.for_run(checkpoint_dir=directory, resume_from=resume, init_from=init,
                        peak_flops=peak)
    check_run_dir(cfg, run_dir, resuming=resume is not None)
    if cfg.checkpoint.every > 0:
        check_checkpoint_dir(Path(directory), named=cfg.checkpoint.dir is not None)
    plan = with_run_data(plan, run_dir)
    check_resumed_data(plan)
    if cfg.train.overwrite:  # every check has passed: the old run goes aside, never mixed
        replace_old_run(run_dir, Path(directory))
    save_run_files(plan, run_dir)
    return plan, launcher


def check_resumed_data(plan: JobPlan) -> None:
    """A resume reads the data the checkpoint's run read (refused otherwise, in one line), in
    the order it read it (warned of otherwise: a new seed or global batch is a choice)."""
    if plan.resume_from is None:
        return
    saved = read_manifest(Path(plan.resume_from)).get("data")
    if saved is None:  # saved before checkpoints recorded their data
        return
    for change in order_changes(saved, plan.cfg):
        print(f"warning: resuming with {change}: the data order from here on is not the "
              f"saved run's", file=sys.stderr)
    changed = (changed_file(saved["files"], fingerprint(data_files(plan.cfg, plan.data_prefixes)))
               or changed_tokenizer(saved, plan.tokenizer))
    if changed:
        raise CheckpointError(f"the data is not what checkpoint {plan.resume_from} trained on: "
                              f"{changed}; restore it, or start a new run from the "
                              f"checkpoint's weights with checkpoint.init_from="
                              f"{plan.resume_from}")


class RunFailed(Exception):
    """The workers did not finish: ``line`` says why, ``code`` is the exit status."""

    def __init__(self, line: str, code: int = WORKER_FAILED_EXIT):
        super().__init__(line)
        self.line, self.code = line, code


def run(plan: JobPlan, launcher: Launcher, run_dir: Path, last: bool = True) -> bool:
    """Launch the workers; True when they trained here, False when they were left running
    (a Slurm job). A failure raises ``RunFailed``; a signal exits with its status. ``last``:
    nothing follows in this command (not a sweep's cell), so once the workers have returned,
    a signal stops nothing and the finished run exits 0 (``console.work_done``)."""
    from launch.launchers.failures import LaunchFailed, LaunchInterrupted, WorkerFailure

    started = time.time()
    raise_if_interrupted()
    try:
        if plan.cfg.launcher.min_nodes is not None:
            from launch.launchers.elastic import run_elastic

            results = run_elastic(plan, run_dir, launcher)
        else:
            results = launch(plan, run_dir, launcher)
    except WorkerFailure as err:
        raise RunFailed(failure_line(err, run_dir, started)) from None
    except LaunchFailed as err:
        raise RunFailed(str(err)) from None
    except LaunchInterrupted as err:
        print(f"interrupted: {err}", file=sys.stderr)
        sys.exit(128 + err.signal_number)  # the shell's convention: 143 for SIGTERM
    except OSError as err:  # the launcher's own files (worker logs) on a full disk
        raise RunFailed(str(write_error(run_dir, err)), USER_ERROR_EXIT) from None
    if last:  # every step is trained and saved: the report below is all that is left
        work_done()
    if results is None:
        return False
    report_results(results, run_dir)
    return True


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _train(dict_cfg: DictConfig) -> None:
    """One run; in a sweep (``-m``) one cell, whose outcome is recorded for the sweep's
    report (``launch.reports.sweep_report``) instead of ending the sweep."""
    cfg = to_dataclass(dict_cfg, Config)
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    cell = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        trained = run(*prepare(cfg, run_dir), run_dir, last=not cell)
    except UserError as err:
        if not cell:
            discard_scaffolding(run_dir)
            exit_user_error(err)
        _record_cell(run_dir, "skipped", " ".join(str(err).split("\n")), hydra_cfg)
    except RunFailed as err:
        if not cell:
            print(f"error: {err.line}", file=sys.stderr)
            sys.exit(err.code)
        _record_cell(run_dir, "failed", err.line, hydra_cfg)
    else:
        if cell:
            _record_cell(run_dir, "completed" if trained else "submitted", "", hydra_cfg)


def discard_scaffolding(run_dir: Path) -> None:
    """A run refused before it wrote anything leaves nothing behind: Hydra made the run
    directory with its ``.hydra/`` and an empty ``train.log`` before hybrid saw the config;
    remove them (and Hydra's dated folder and ``outputs/`` above, once empty). A directory with
    anything else in it is left as it is."""
    log = run_dir / "train.log"
    names = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else {".x"}
    if not names <= {".hydra", "train.log"} or (log.exists() and log.stat().st_size):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    dated = run_dir.parent
    if dated.parent.name == "outputs":
        for folder in (dated, dated.parent):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def _record_cell(run_dir: Path, status: str, reason: str, hydra_cfg) -> None:
    from launch.reports.sweep_report import record_cell

    if status in ("skipped", "failed"):
        print(f"{status}: {reason}", file=sys.stderr)
    record_cell(run_dir, status, reason, list(hydra_cfg.overrides.task))


def main() -> None:
    """Ctrl-C is reported by the console script (``launch.commands.console``), even during imports."""
    run_hydra_app(_train)


if __name__ == "__main__":
    main()
