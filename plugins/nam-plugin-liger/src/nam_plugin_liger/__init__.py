"""nam plugin liger: the LM head and MTP heads through Liger-Kernel's fused linear cross-entropy."""
