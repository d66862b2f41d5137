"""nam plugin deepep: Megatron's flex MoE token dispatcher on DeepEP's intranode kernels for expert parallelism > 1."""
