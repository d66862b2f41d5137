"""nam plugin lemyx: DSA indexer warm-up with dense attention and the indexer KL in one fused pass."""
