"""The ``hybrid-train`` console script: one line on Ctrl-C, whenever it comes.

The script's module must be light: a Ctrl-C while ``launch.train`` imports Hydra and torch
(the first second or two) would otherwise print a traceback of the import machinery.
"""

from __future__ import annotations

import sys

INTERRUPTED_EXIT = 130


def train() -> None:
    try:
        from launch.train import main

        main()
    except KeyboardInterrupt as err:
        detail = str(err) or "stopped before any worker started"
        print(f"interrupted: {detail}", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
