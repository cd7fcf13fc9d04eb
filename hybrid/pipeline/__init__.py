"""Pipeline parallelism: pure schedules (actions, schedules, check, simulate), the partitioner
and timelines; the runtime that executes schedules lives beside them."""
