"""Planning: everything decided before a worker starts, as pure Python (no torch).

The config schema (``config``), the rank layout and its axes and roles (``layout``), the
parameter specs (``params``), validation (``validate``), the frozen job plan (``job``) and
its views (``view``, ``memory``), pipeline schedules as data (``schedules``), the DP strategies'
facts (``strategies``) and the cost model (``cost``). The runtime (the rest of ``hybrid``)
imports this package; this package imports nothing of the runtime (``tests/test_structure.py``).
"""
