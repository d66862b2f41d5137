"""nam plugin fp8-moe: NAM56R's routed-expert GEMMs in FP8 (per-tensor scales, amax history); the rest bf16."""
