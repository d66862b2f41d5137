"""nam plugin __NAME__."""
