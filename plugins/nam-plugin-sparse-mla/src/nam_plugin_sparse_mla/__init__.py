"""nam plugin sparse-mla: DSA's sparse MLA attention in absorbed form, as Triton kernels."""
