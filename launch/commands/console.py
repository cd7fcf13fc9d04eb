"""The ``hybrid-train`` console script: one line on Ctrl-C, whenever it comes.

The script's module must be light: a Ctrl-C while ``launch.commands.train`` imports Hydra and torch
(the first second or two) would otherwise print a traceback of the import machinery.

It also starts the workers' fork server first thing, when the command line may start workers
here: the server's imports of torch and megatron-core (the longest part of a launch) then
overlap the launcher's own start (Hydra, the checks), and the script ends the server when it
exits, so that a refused config leaves nothing behind.
"""

from __future__ import annotations

import os
import sys

from launch.launchers.failures import interrupted_by

INTERRUPTED_EXIT = 130


def train() -> None:
    early = False
    try:
        early = may_start_workers_here(sys.argv[1:])
        if early:
            from launch.launchers.agent import MEGATRON_IMPORT_WARNING, WORKER_PRELOAD, start_fork_server

            os.environ.setdefault("PYTHONWARNINGS", MEGATRON_IMPORT_WARNING)
            start_fork_server(WORKER_PRELOAD)
        from launch.commands.train import main

        main()
    except Exception as err:
        interrupt = interrupted_by(err)
        if interrupt is None:
            raise
        _report_interrupt(interrupt)
    except KeyboardInterrupt as err:
        _report_interrupt(err)
    finally:
        if early:
            from launch.launchers.agent import stop_fork_server

            stop_fork_server()


def may_start_workers_here(args: list[str]) -> bool:
    """Whether ``hybrid-train ARGS`` may start workers on this machine through the fork
    server: plain overrides, no flag (``--help``, ``-m``, ``--cfg``), not ``launcher=slurm``
    nor ``launcher.start_method=spawn``. Only a guess, for starting the server early."""
    if any(arg.startswith("-") for arg in args):
        return False
    values = dict(arg.split("=", 1) for arg in args if "=" in arg)
    return (values.get("launcher", "local") in ("local", "torchrun")
            and values.get("launcher.start_method", "forkserver") == "forkserver")


def _report_interrupt(err: KeyboardInterrupt) -> None:
    detail = str(err) or "stopped before any worker started"
    print(f"interrupted: {detail}", file=sys.stderr)
    sys.exit(INTERRUPTED_EXIT)
