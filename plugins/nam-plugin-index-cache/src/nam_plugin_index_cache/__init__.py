"""nam plugin index-cache: DSA Shared layers reuse the top-k of the nearest earlier Full layer."""
