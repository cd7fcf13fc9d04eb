"""The one base class of every error a person can fix from the command line (pure).

A ``UserError``'s message is one line: what is wrong, the values, and the fix
(``parallel.tp=3 does not divide model.heads=4; choose tp in {1, 2, 4}``). Each entry point
(``hybrid-train``, ``hybrid-plan``, ``hybrid-data``, ``hybrid-ckpt``, ``hybrid-compare``)
catches this class, and only it, prints the line and exits with status 2; a worker that raises
one ends the run with that line (``hybrid.worker``). Any other exception from hybrid's own
code is a bug and keeps its traceback, so a bug never looks like a typo. Each area names its
own subclasses (``LayoutError``, ``DataError``, ``CheckpointError``, ...).
"""

from __future__ import annotations

USER_ERROR_EXIT = 2
"""The exit status of every entry point that refuses its input."""


class UserError(Exception):
    """Something the person running hybrid can fix; ``str(err)`` is the one line to show."""
