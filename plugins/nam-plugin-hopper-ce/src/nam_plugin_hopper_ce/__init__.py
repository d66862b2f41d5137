"""nam plugin hopper-ce: NAM56R's LM and MTP heads through a fused linear cross-entropy built for Hopper."""
