"""nam plugin dualpipev: the DualPipeV pipeline schedule, two V-shaped model chunks per pipeline rank."""
