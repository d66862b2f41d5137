"""nam plugin te: Transformer Engine linears (bf16 and FP8) for NAM56R, in the local and the megatron engine."""
