"""The ``hybrid-train`` console script: one line on Ctrl-C, whenever it comes.

The script's module must be light: a Ctrl-C while ``launch.commands.train`` imports Hydra and torch
(the first second or two) would otherwise print a traceback of the import machinery.

The workers' fork server starts as soon as the config has passed its checks
(``launch.launchers.run.start_workers_fork_server``); the script ends it when it exits, so that
a run refused after that (its data, its checkpoint) leaves nothing behind.
"""

from __future__ import annotations

import sys

from launch.launchers.failures import interrupted_by

INTERRUPTED_EXIT = 130


def train() -> None:
    try:
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
        from launch.launchers.fork_server import stop_fork_server

        stop_fork_server()


def _report_interrupt(err: KeyboardInterrupt) -> None:
    detail = str(err) or "stopped before any worker started"
    print(f"interrupted: {detail}", file=sys.stderr)
    sys.exit(INTERRUPTED_EXIT)
