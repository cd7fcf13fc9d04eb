"""The ``hybrid-train`` console script: one line on Ctrl-C, whenever it comes.

The script's module must be light: a Ctrl-C while ``launch.train`` imports Hydra and torch
(the first second or two) would otherwise print a traceback of the import machinery.
"""

from __future__ import annotations

import sys

INTERRUPTED_EXIT = 130


def interrupted_by(err: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C behind ``err``, if any: a KeyboardInterrupt that lands inside a library's
    cleanup (OmegaConf restoring its flags while Hydra composes the config) comes back as
    another exception whose context is the interrupt."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def train() -> None:
    try:
        from launch.train import main

        main()
    except Exception as err:
        interrupt = interrupted_by(err)
        if interrupt is None:
            raise
        _report_interrupt(interrupt)
    except KeyboardInterrupt as err:
        _report_interrupt(err)


def _report_interrupt(err: KeyboardInterrupt) -> None:
    detail = str(err) or "stopped before any worker started"
    print(f"interrupted: {detail}", file=sys.stderr)
    sys.exit(INTERRUPTED_EXIT)
