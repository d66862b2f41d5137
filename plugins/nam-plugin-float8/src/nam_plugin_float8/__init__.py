"""nam plugin float8: FP8 training through torchao for the dense projections and the routed experts."""
