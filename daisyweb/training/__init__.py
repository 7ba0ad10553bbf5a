"""Training: the run config, one peer's train state, the local loop, metrics, the replay oracle."""
