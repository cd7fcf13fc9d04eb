"""Balance at run time: DP replicas' shares by measured speed, and the worker's side of
elastic re-layout."""
