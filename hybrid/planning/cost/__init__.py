"""The cost model (pure): parameter and memory sizes, FLOPs, ring collectives, devices, the
DP options' traffic and time, the predicted step, the layout search and the published runs
it is checked against."""
