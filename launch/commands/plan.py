"""``hybrid-plan``: print what a config would run, without starting anything.

Takes the same overrides as ``hybrid-train`` plus ``format=json``; ``search.world=N`` ranks
every layout of N devices instead (``hybrid.planning.cost.search``)::

    hybrid-plan parallel.dp=2 parallel.tp=2 parallel.pp=2 format=json
    hybrid-plan model=gpt-1t train.global_batch=3072 search.world=3072 cost.device=a100-80gb
    hybrid-plan calibrate        # measure this machine (launch/calibration/calibrate.py)
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from hybrid.errors import UserError
from hybrid.files import RunDirError
from hybrid.planning.config import PlanConfig
from hybrid.planning.layout import LayoutError
from hybrid.planning.memory import memory_verdict
from hybrid.planning.cost.sizes import human_bytes
from hybrid.planning.cost.device_files import source_dict
from hybrid.planning.cost.devices import device_for
from hybrid.planning.cost.dp_options import compare_dp_options
from hybrid.planning.job import plan_job
from hybrid.planning.cost.block_costs import known_block_costs
from hybrid.planning.view import format_plan, plan_dict
from hybrid.planning.cost.search import format_search, no_layout_line, overrides_of, search
from hybrid.planning.cost.search_limits import search_limits
from hybrid.planning.cost.software import software_named
from hybrid.planning.cost.replicas import replica_line, replica_prediction
from hybrid.planning.cost.mixed import (
    cluster, node_devices_problem, node_groups_line, plan_mixed,
)
from hybrid.planning.cost.mixed_report import (
    mixed_lines, mixed_search, mixed_search_lines, with_mixed,
)
from hybrid.planning.cost.steptime import predict_step
from hybrid.planning.cost.trust import assumption_line
from hybrid.planning.validate import config_problems, position_warnings
from launch.launchers.registered import unknown_launcher
from hybrid.interop.hf_source import with_hf_shape
from launch.launchers.run import save_run_files
from launch.commands.app import (CONF_DIR, available_memory, exit_user_error, run_hydra_app,
                                 to_dataclass, typed_overrides)


@hydra.main(config_path=CONF_DIR, config_name="plan", version_base="1.3")
def _plan(dict_cfg: DictConfig) -> None:
    cfg = to_dataclass(dict_cfg, PlanConfig)
    try:  # model.from_hf: the shape of the HF folder's config.json
        cfg = with_hf_shape(cfg, typed_overrides())
    except UserError as err:
        exit_user_error(err)
    for warning in position_warnings(cfg.model):
        print(f"warning: {warning}", file=sys.stderr)
    if cfg.format not in ("text", "json"):
        exit_user_error(f"format={cfg.format!r} is unknown; choose text or json")
    # A plan may be for another machine than a launcher could start here (launcher.nnodes=2
    # without launcher=torchrun's endpoint): only an unknown launcher is refused.
    par = cfg.parallel
    world = cfg.search.world or par.dp * par.cp * par.tp * par.pp
    problems = config_problems(cfg) + [p for p in [unknown_launcher(cfg),
                                                   node_devices_problem(cfg, world)] if p]
    if problems:  # all of them, one line each
        for problem in problems[:-1]:
            print(f"error: {problem}", file=sys.stderr)
        exit_user_error(problems[-1])
    try:
        device, software = device_for(cfg.cost), software_named(cfg.cost.software)
        if cfg.search.world:
            _search(cfg, device, software)
            return
        # partition=measured: plan with an existing calibration file's costs
        job = plan_job(cfg.job(), block_costs=known_block_costs(cfg))
        device = software.device(device, job.layout.pp)
        if cfg.out is not None:  # the config's split: the runtime does not take a mixed one
            write_run_files(job, Path(cfg.out))
        mixed = None
        if cfg.cost.node_devices is not None:  # the layers split by each node's device
            mixed = plan_mixed(cfg.job(), cluster(cfg, software, job.layout.pp),
                               block_costs=known_block_costs(cfg))
            job, device = mixed.plan.placed(mixed.plan.priced_ranks_per_node), mixed.link
    except UserError as err:
        exit_user_error(err)
    plan = plan_dict(job)  # one plan, printed and priced
    if mixed is not None:
        plan = with_mixed(plan, mixed)
        plan["mixed_nodes"]["node_groups"] = node_groups_line(cfg)
    predicted = plan["mixed_nodes"].pop("slowest") if mixed else predict_step(job, device)
    plan["predicted"] = predicted.to_dict() | {
        "device": "+".join(dict.fromkeys(d.name for d in mixed.nodes)) if mixed
        else device.name, "device_file": source_dict(device.file, device.file_time),
        "software": software.name, "software_does": software.summary,
        "assumes": assumption_line(device, cfg),
        "device_from": "cost.node_devices" if mixed else "cost.device"}
    if job.layout.dp > 1 and mixed is None:  # the options are priced on one device
        plan["dp_options"] = compare_dp_options(cfg, device)
    if cfg.cost.replica_speed is not None:
        plan["replica_balance"] = replica_prediction(job, device, cfg.cost.replica_speed)
    limit, memory_kind = memory_limit(cfg, device)
    if limit is not None and mixed is None:
        plan["memory_check"] = memory_verdict(cfg, limit, memory_kind)
    if cfg.format == "json":
        print(json.dumps(plan, indent=1))
    else:
        print(format_plan(plan, full=cfg.full))
        if "memory_check" in plan:
            print(f"\nmemory check: {plan['memory_check']['line']}")
        print(f"\n{prediction_line(plan['predicted'])}")
        if "dp_options" in plan:
            print("\n" + format_dp_options(plan["dp_options"]))
        if "replica_balance" in plan:
            print("\n" + replica_line(plan["replica_balance"]))
        if "mixed_nodes" in plan:
            print("\n" + mixed_lines(plan["mixed_nodes"]))


def write_run_files(job, run_dir: Path) -> None:
    """``config.json`` and ``plan.json`` of a run that a launcher of the user's starts (with
    its data checked and an indexed source's caches built)."""
    from hybrid.data import validate_data
    from launch.commands.run_data import with_run_data

    validate_data(job.cfg.data, job.cfg.model, job.cfg.train, job.cfg.eval)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        job = with_run_data(job, run_dir)
        save_run_files(job, run_dir)
    except OSError as err:
        raise RunDirError(f"cannot write {run_dir}: {err}; choose another out=") from None
    print(f"wrote {run_dir / 'config.json'} and {run_dir / 'plan.json'}: start the ranks with "
          f"torchrun --nproc-per-node {job.ranks_per_node} -m hybrid.worker {run_dir}",
          file=sys.stderr)


def format_dp_options(rows: list[dict]) -> str:
    """The DP options priced on this layout, one line each (docs/data-parallel.md)."""
    lines = ["data-parallel options on this layout (predicted, and the lossy ones change the "
             "loss: docs/data-parallel.md):",
             "  option          step s    DP shown s  DP bytes/step  memory/rank"]
    for row in rows:
        lines.append(f"  {row['option']:<15} {row['step_time_s']:<9.4g} "
                     f"{row['dp_exposed_s']:<11.3g} {human_bytes(row['dp_bytes_per_step']):<14} "
                     f"{human_bytes(row['mem_bytes_per_rank'])}"
                     f"{'' if row['exact'] else '  (lossy)'}")
    return "\n".join(lines)


def prediction_line(p: dict) -> str:
    beside = p["dp_contention_s"]  # compute slowed by the SMs a hidden reduction holds
    lost = f", compute lost beside it {beside:.3g} s" if beside else ""
    named = p.get("device_from", "cost.device")
    return (f"predicted on {p['device']} ({named}) running {p['software']} "
            f"(cost.software): step {p['step_time_s']:.4g} s "
            f"(bubble {p['bubble_s']:.3g} s, TP {p['tp_s']:.3g} s, DP exposed "
            f"{p['dp_exposed_s']:.3g} s{lost}), {p['tflops_per_device']:.4g} TFLOP/s per device\n"
            f"{p['assumes']}")


def memory_limit(cfg: PlanConfig, device) -> tuple:
    """What the plan's memory is checked against: a device of its own per rank when
    ``cost.device`` is one (planning a GPU job here checks the GPU's memory, not this host's),
    else what this machine's ranks can use."""
    if not device.host:
        return device.memory_bytes, device.name
    return available_memory(cfg)


def _search(cfg: PlanConfig, device, software) -> None:
    if cfg.search.world < 1 or cfg.search.top < 1:
        raise LayoutError(f"search.world={cfg.search.world} and search.top={cfg.search.top} "
                          f"must be integers >= 1")
    limits = search_limits(cfg, software, cfg.search.keep, cfg.search.schedules)
    if cfg.cost.node_devices is not None:
        result = mixed_search(cfg, cfg.search.world, software, cfg.search.top, limits)
        print(json.dumps(result, indent=1) if cfg.format == "json"
              else mixed_search_lines(result))
        return
    result = search(cfg, cfg.search.world, device, top=cfg.search.top, limits=limits)
    if not result["candidates"]:
        raise LayoutError(no_layout_line(result))
    result["assumes"] = assumption_line(device, cfg)
    result["device_file"] = source_dict(device.file, device.file_time)
    result["run_best"] = "hybrid-train " + " ".join(
        shlex.quote(o) for o in cell_overrides(result["candidates"][0]["settings"]))
    print(json.dumps(result, indent=1) if cfg.format == "json" else format_search(result),
          flush=True)
    if cfg.search.run:
        run_as_sweep(cfg, [c["settings"] for c in result["candidates"]])


PLAN_ONLY_KEYS = ("search.", "format=", "full=", "out=")
SEARCH_PLACES = ("launcher.nnodes", "launcher.nproc_per_node", "launcher.node_rank")
"""What the search sets itself: its layouts are of one node's ranks."""


def cell_overrides(settings: dict) -> list[str]:
    """``hybrid-train``'s overrides for a searched layout: those ``hybrid-plan`` was given
    (the model, batch, precision, data, ... the search was for; not its own keys, Hydra's or
    what the layout sets), then the layout's. They compose to the config the search priced."""
    from hydra.core.hydra_config import HydraConfig

    cell = overrides_of(settings)
    taken = {_key(o) for o in cell} | set(SEARCH_PLACES)
    return [o for o in HydraConfig.get().overrides.task
            if not o.startswith(PLAN_ONLY_KEYS) and not _key(o).startswith("hydra.")
            and _key(o) not in taken] + cell


def _key(override: str) -> str:
    """``+model.x=1`` -> ``model.x``."""
    return override.split("=", 1)[0].lstrip("+~")


def run_as_sweep(cfg: PlanConfig, layouts: list[dict]) -> None:
    """Train every searched layout with ``hybrid-train`` (the user's overrides, then the
    layout's), one after another, recording how each ended; then write the sweep report."""
    from launch.reports.sweep_report import record_cell, write_report

    sweep_dir = Path(cfg.search.dir or f"multirun/search-{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    train = str(Path(sys.executable).parent / "hybrid-train")
    for i, settings in enumerate(layouts):
        cell = cell_overrides(settings)
        run_dir = (sweep_dir / str(i)).resolve()
        print(f"cell {i}: hybrid-train {' '.join(overrides_of(settings))}", flush=True)
        done = subprocess.run([train, *cell, f"hydra.run.dir={run_dir}"],
                              stderr=subprocess.PIPE, text=True)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        reason = errors[-1].removeprefix("error: ") if errors else ""
        status = {0: "completed", 2: "skipped"}.get(done.returncode, "failed")
        if done.returncode not in (0, 2) and not reason:
            reason = f"hybrid-train exited {done.returncode}"
        record_cell(run_dir, status, reason, cell)
    print(f"sweep report: {write_report(sweep_dir)}")


def main() -> None:
    if sys.argv[1:2] == ["calibrate"]:  # a measurement, not a plan: its own flags
        from launch.calibration import calibrate

        calibrate.main(sys.argv[2:])
        return
    run_hydra_app(_plan)


if __name__ == "__main__":
    main()
