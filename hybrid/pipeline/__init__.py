"""Pipeline parallelism at run time: the interpreter that runs one rank's action list
(``runtime``), its messages (``p2p``), the split backward (``backward``), what a rank builds from
the plan (``stages``), timelines of real steps and block timing. The schedules themselves are
pure data, in ``hybrid.planning.schedules``."""
