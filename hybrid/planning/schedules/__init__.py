"""Pipeline schedules as data (pure): actions, the schedule builders, the lowering that adds
sends and receives, the checker, the simulator, the per-rank plan and the stage partitioner."""
